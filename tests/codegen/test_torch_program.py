"""The CPU target's generated program: one function for the whole plan, matching eager
at changing sizes, writing state in place, never returning the caller's tensors, naming
the op's line for a bad index, and each fast call form meaning its ATen op."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.codegen.torch_program import _FAST, TorchProgram
from kiln.errors import IndexOutOfRangeError
from kiln.ir.ops import resolve
from tests.helpers import rel_err


class Block(torch.nn.Module):
    """A state write at given positions, a split SwiGLU, a read of the state."""

    def __init__(self, d=16, f=24, slots=32):
        super().__init__()
        self.w13 = torch.nn.Linear(d, 2 * f, bias=False)
        self.w2 = torch.nn.Linear(f, d, bias=False)
        self.register_buffer("cache", torch.zeros(slots, d))

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x)
        g, u = self.w13(x).chunk(2, -1)
        return x + self.w2(F.silu(g) * u) + self.cache.sum(0)


def test_one_function_matches_eager_at_changing_sizes():
    model, eager = Block().eval(), Block().eval()
    eager.load_state_dict(model.state_dict())
    T = kiln.Dim("T", min=2, max=32)
    exe = kiln.compile(model, (torch.randn(4, 16), torch.arange(4)),
                       dynamic_shapes=({0: T}, {0: T}))
    assert isinstance(exe.program._whole, TorchProgram)
    with torch.no_grad():
        for t in (5, 3, 9, 5):
            x, pos = torch.randn(t, 16), torch.randperm(32)[:t]
            assert rel_err(exe(x, pos), eager(x, pos)) <= 1e-5
            assert rel_err(model.cache, eager.cache) <= 1e-5  # written in place
    assert exe.program.arena.storage is None  # intermediates are the ops' own tensors


class Views(torch.nn.Module):
    """Outputs that in eager alias an input and a weight, and one value returned twice."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        y = x * 2
        return x.view(4, 3), self.w.t(), y, y


def test_outputs_are_never_the_callers_tensors():
    model = Views().eval()
    x = torch.randn(3, 4)
    exe = kiln.compile(model, (x,))
    with torch.no_grad():
        outs, refs = exe(x), model(x)
    for o, r in zip(outs, refs):
        assert torch.equal(o, r)
    outs[0].zero_()
    outs[1].zero_()
    outs[2].add_(1)
    assert x.abs().sum() > 0 and model.w.abs().sum() > 0
    assert not torch.equal(outs[2], outs[3])


class Lookup(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)

    def forward(self, ids):
        h = torch.relu(ids.float().unsqueeze(-1))
        return self.emb(ids) + h


def test_bad_index_names_the_line():
    exe = kiln.compile(Lookup().eval(), (torch.tensor([1, 2]),))
    with pytest.raises(IndexOutOfRangeError) as e:
        exe(torch.tensor([1, 12]))
    assert "test_torch_program.py" in e.value.where and "self.emb(ids)" in e.value.where


_A, _B, _V = torch.randn(2, 3, 4), torch.randn(2, 4, 5), torch.randn(4)
_SAMPLES = {  # per fast form: arguments as the graph holds them
    "aten.view.default": (_A, [6, 4]),
    "aten._unsafe_view.default": (_A, [2, 12]),
    "aten.reshape.default": (_A, [3, -1]),
    "aten.permute.default": (_A, [2, 0, 1]),
    "aten.expand.default": (torch.randn(3, 1), [2, 3, 5]),
    "aten.select.int": (_A, 1, -1),
    "aten.squeeze.dims": (torch.randn(2, 1, 3, 1), [1, 3]),
    "aten.squeeze.dim": (torch.randn(2, 1, 3), 1),
    "aten.squeeze.default": (torch.randn(1, 2, 1),),
    "aten.unsqueeze.default": (_A, -2),
    "aten.transpose.int": (_A, 0, 2),
    "aten.t.default": (torch.randn(3, 4),),
    "aten.mm.default": (_A[0], _B[0]),
    "aten.bmm.default": (_A, _B),
    "aten.addmm.default": (torch.randn(5), _A[0], _B[0]),
    "aten.add.Tensor": (_A, 2.5),
    "aten.sub.Tensor": (torch.arange(4), _V),
    "aten.mul.Tensor": (_A, _V),
    "aten.div.Tensor": (torch.arange(4), torch.tensor(3)),
    "aten.relu.default": (_A,),
    "aten.clone.default": (_A.transpose(0, 1),),
}


@pytest.mark.parametrize("target", sorted(_FAST))
def test_fast_form_is_the_aten_op(target):
    args = _SAMPLES[target]
    names = [f"a{i}" for i in range(len(args))]
    form, most = _FAST[target]
    assert len(args) <= most
    fast = eval(form.format(*(n if isinstance(a, torch.Tensor) else repr(a)
                              for n, a in zip(names, args))),
                {"torch": torch, **dict(zip(names, args))})
    ref = resolve(target)(*args)
    assert fast.dtype == ref.dtype and fast.shape == ref.shape
    assert torch.equal(fast, ref)
