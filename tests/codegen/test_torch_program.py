"""The CPU target's generated program: one function for the whole plan, matching eager
at changing sizes, writing state in place, never returning the caller's tensors, naming
the op's line for a bad index, and each fast call form meaning its ATen op."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.codegen.torch_program import FUNCTIONS, METHODS, TorchProgram
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
_I = torch.tensor([[0, 2], [1, 1]])
_F32 = {"dtype": torch.float32, "layout": torch.strided, "device": torch.device("cpu"),
        "pin_memory": False}
_LSTM = [torch.randn(12, 4), torch.randn(12, 3), torch.randn(12), torch.randn(12)]
_GRU = [torch.randn(9, 4), torch.randn(9, 3), torch.randn(9), torch.randn(9)]
_SAMPLES = {  # per fast form: (arguments, keyword arguments) as the graph holds them
    "aten.view.default": ((_A, [6, 4]), {}),
    "aten._unsafe_view.default": ((_A, [2, 12]), {}),
    "aten.reshape.default": ((_A, [3, -1]), {}),
    "aten.permute.default": ((_A, [2, 0, 1]), {}),
    "aten.expand.default": ((torch.randn(3, 1), [2, 3, 5]), {}),
    "aten.select.int": ((_A, 1, -1), {}),
    "aten.squeeze.dims": ((torch.randn(2, 1, 3, 1), [1, 3]), {}),
    "aten.squeeze.dim": ((torch.randn(2, 1, 3), 1), {}),
    "aten.squeeze.default": ((torch.randn(1, 2, 1),), {}),
    "aten.unsqueeze.default": ((_A, -2), {}),
    "aten.transpose.int": ((_A, 0, 2), {}),
    "aten.t.default": ((torch.randn(3, 4),), {}),
    "aten.mm.default": ((_A[0], _B[0]), {}),
    "aten.bmm.default": ((_A, _B), {}),
    "aten.addmm.default": ((torch.randn(5), _A[0], _B[0]), {"beta": 0.5, "alpha": 2}),
    "aten.baddbmm.default": ((torch.randn(3, 5), _A, _B), {}),
    "aten.add.Tensor": ((_A, 2.5), {"alpha": 3}),
    "aten.sub.Tensor": ((torch.arange(4), _V), {}),
    "aten.mul.Tensor": ((_A, _V), {}),
    "aten.div.Tensor": ((torch.arange(4), torch.tensor(3)), {}),
    "aten.pow.Tensor_Scalar": ((_A, 2), {}),
    "aten.neg.default": ((_A,), {}),
    "aten.relu.default": ((_A,), {}),
    "aten.sigmoid.default": ((_A,), {}),
    "aten.tanh.default": ((_A,), {}),
    "aten.exp.default": ((_A,), {}),
    "aten.rsqrt.default": ((_A.abs(),), {}),
    "aten.sqrt.default": ((_A.abs(),), {}),
    "aten.cos.default": ((_A,), {}),
    "aten.sin.default": ((_A,), {}),
    "aten.gelu.default": ((_A,), {"approximate": "tanh"}),
    "aten.silu.default": ((_A,), {}),
    "aten.clone.default": ((_A.transpose(0, 1),), {"memory_format": torch.contiguous_format}),
    "aten.where.self": ((_A > 0, _A, _V), {}),
    "aten.eq.Tensor": ((_I, torch.tensor(1)), {}),
    "aten.eq.Scalar": ((_I, 1), {}),
    "aten.ne.Scalar": ((_I, 1), {}),
    "aten.le.Tensor": ((_I, _I.t()), {}),
    "aten.ge.Scalar": ((_I, 1), {}),
    "aten.bitwise_and.Tensor": ((_I > 0, _I < 2), {}),
    "aten.mean.dim": ((_A, [-1, 0], True), {}),
    "aten.sum.dim_IntList": ((_A, [1]), {"dtype": torch.float64}),
    "aten.amax.default": ((_A, [2], True), {}),
    "aten.cumsum.default": ((_I, 1), {"dtype": torch.int32}),
    "aten._softmax.default": ((_A, -1, False), {}),
    "aten.cat.default": (([_A, _A * 2], 1), {}),
    "aten.full.default": (([2, 3], 0.5), _F32),
    "aten.arange.start_step": ((2, 11, 3), {**_F32, "dtype": torch.int64}),
    "aten.embedding.default": ((torch.randn(5, 3), _I), {}),
    "aten.native_layer_norm.default": ((_A, [4], _V, _V + 1, 1e-5), {}),
    "aten.scaled_dot_product_attention.default": (
        (_A[None], _A[None], _A[None], None, 0.0, True), {"scale": 0.3}),
    "aten.convolution.default": ((torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3),
                                  torch.randn(3), [2, 1], [1, 0], [1, 1], False, [0, 0], 1), {}),
    "aten.max_pool2d_with_indices.default": ((torch.randn(1, 2, 5, 5), [2, 2], [2, 1]), {}),
    "aten.lstm.input": ((torch.randn(2, 5, 4), [torch.zeros(1, 2, 3), torch.zeros(1, 2, 3)],
                         _LSTM, True, 1, 0.0, False, False, True), {}),
    "aten.gru.input": ((torch.randn(5, 2, 4), torch.randn(1, 2, 3), _GRU, True, 1, 0.0,
                        False, False, False), {}),
}


@pytest.mark.parametrize("target", sorted(METHODS) + sorted(FUNCTIONS))
def test_fast_form_is_the_aten_op(target):
    args, kwargs = _SAMPLES[target]
    if target in METHODS:
        method, most = METHODS[target]
        assert len(args) <= most and not kwargs
        fast = getattr(args[0], method)(*args[1:])
    else:
        fast = FUNCTIONS[target](*args, **kwargs)
    ref = resolve(target)(*args, **kwargs)
    fast, ref = (o if isinstance(o, tuple | list) else [o] for o in (fast, ref))
    assert len(fast) == len(ref)
    for f, r in zip(fast, ref):
        assert f.dtype == r.dtype and f.shape == r.shape
        assert torch.equal(f, r)


class TwoReaders(torch.nn.Module):
    """One normalised value read by two projections (two matmul regions)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 8, bias=False)
        self.b = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        return self.a(h) * self.b(h)


def test_an_op_copied_into_regions_runs_once():
    model = TwoReaders().eval()
    x = torch.randn(2, 3, 16)
    exe = kiln.compile(model, (x,))
    names = [op.name for r in exe.plan.regions for op in r.ops]
    assert len(names) > len(set(names))  # region formation copied an op (the view)
    live = set()
    for line in exe.program._whole.source.splitlines():
        line = line.strip()
        if line.startswith("del "):
            live -= {n.strip() for n in line[4:].split(",")}
        elif " = " in line:
            var = line.split(" = ")[0]
            assert var not in live, line  # computed again while held
            live.add(var)
    with torch.no_grad():
        assert rel_err(exe(x), model(x)) <= 1e-5
