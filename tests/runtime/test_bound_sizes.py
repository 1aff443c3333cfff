"""A Program keeps what depends only on a call's sizes (bound launches, arena views) and
reuses it: calls whose sizes change between calls, repeat, grow the arena or outnumber
what it keeps give eager's results, and the guards still check every call.

The CPU target runs one generated function instead (tests/codegen/test_torch_program.py),
so the kept launches are tested on the interpret target, or on the CPU through another
arena (CUDA graphs' path)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.errors import DTypeError, ShapeError
from kiln.runtime.memory_plan import Arena
from tests.helpers import rel_err

D, SLOTS = 16, 32


class Block(torch.nn.Module):
    """RMSNorm, a state write at given positions, a split SwiGLU, a read of the state,
    a column gather (an index list of None and a tensor), and an integer product (no
    kernel: its region runs as torch ops)."""

    def __init__(self, d=D, f=24, slots=SLOTS):
        super().__init__()
        self.norm = torch.nn.RMSNorm(d, eps=1e-5)
        self.w13 = torch.nn.Linear(d, 2 * f, bias=False)
        self.w2 = torch.nn.Linear(f, d, bias=False)
        self.register_buffer("cache", torch.zeros(slots, d))
        self.register_buffer("cols", torch.randperm(d))

    def forward(self, x, pos):
        h = self.norm(x)
        self.cache.index_copy_(0, pos, h)
        g, u = self.w13(h).chunk(2, -1)
        y = x + self.w2(F.silu(g) * u) + self.cache.sum(0)
        return y[:, self.cols] + 1e-3 * (pos[:, None] @ pos[None, :1]).float()


def _compiled(target):
    model = Block().eval()
    eager = copy.deepcopy(model)
    T = kiln.Dim("T", min=2, max=SLOTS)
    exe = kiln.compile(model, (torch.randn(4, D), torch.arange(4)),
                       dynamic_shapes=({0: T}, {0: T}), target=target)
    return model, eager, exe


def _call(exe, eager, model, t):
    x, pos = torch.randn(t, D), torch.randperm(SLOTS)[:t]
    out, ref = exe(x, pos), eager(x, pos)
    assert rel_err(out, ref) <= 1e-5, (t, rel_err(out, ref))
    assert rel_err(model.cache, eager.cache) <= 1e-5, t  # the state written in place


def test_sizes_changing_between_calls_match_eager():
    model, eager, exe = _compiled("interpret")
    kinds = {k.kind for k in exe.program.kplan.kernels.values()}
    assert kinds == {"triton", "torch"}, kinds  # generated kernels and a torch region
    prog = exe.program
    binds = []
    bind_sizes = prog._bind_sizes
    prog._bind_sizes = lambda env, arena: binds.append(dict(env)) or bind_sizes(env, arena)
    with torch.no_grad():
        for t in (5, 3, 5, 3):  # a, b, a again: bound once per size
            _call(exe, eager, model, t)
        assert len(binds) == 2
        _call(exe, eager, model, 9)  # more than the arena holds: it grows
        assert len(prog._bound) == 1  # the others' views point into the old storage
        for t in (5, 3, 9):
            _call(exe, eager, model, t)
        assert len(binds) == 5


def test_bound_and_fresh_launches_agree_bitwise():
    model, _, exe = _compiled("interpret")
    x, pos = torch.randn(6, D), torch.arange(6)
    saved = model.cache.clone()
    with torch.no_grad():
        exe(torch.randn(3, D), torch.arange(3))
        exe(x, pos)  # binds size 6 ...
        model.cache.copy_(saved)
        kept = exe(x, pos)  # ... and reuses it
        exe.program._bound.clear()
        model.cache.copy_(saved)
        fresh = exe(x, pos)
    assert torch.equal(kept, fresh)


def test_more_sizes_than_kept():
    model, eager, exe = _compiled("interpret")
    exe.program.KEPT_SIZES = 2
    with torch.no_grad():
        for t in (9, 4, 5, 6, 4, 9):
            _call(exe, eager, model, t)
            assert len(exe.program._bound) <= 2


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_guards_check_every_call_at_kept_sizes(target):
    model, eager, exe = _compiled(target)
    with torch.no_grad():
        _call(exe, eager, model, 5)
        with pytest.raises(DTypeError):
            exe(torch.randn(5, D, dtype=torch.float64), torch.arange(5))
        with pytest.raises(ShapeError):
            exe(torch.randn(5, D), torch.arange(4))
        _call(exe, eager, model, 5)


def test_another_arena_is_bound_afresh_and_not_kept():
    """CUDA graphs run a program in their own arena; those runs leave nothing kept."""
    model, eager, exe = _compiled("cpu")
    prog = exe.program
    x, pos = torch.randn(7, D), torch.arange(7)
    own = Arena(prog.mem, prog.plan, prog.device)
    with torch.no_grad():
        out = prog.run([x, pos], exe.state, prog.bind([x, pos]), arena=own)
    assert rel_err(out[0], eager(x, pos)) <= 1e-5
    assert not prog._bound
