"""dispatch/reinplace.py: state updates written into the state's own storage."""

import pytest
import torch

import kiln
from tests.helpers import rel_err


class CountedCache(torch.nn.Module):
    """Two layers of transformers' StaticCache bookkeeping: each layer's position
    counter set from the call's positions, advanced, and used to place the rows."""

    def __init__(self, rows=8, dim=4):
        super().__init__()
        for i in range(2):
            self.register_buffer(f"counter{i}", torch.tensor(0, dtype=torch.int64))
            self.register_buffer(f"cache{i}", torch.zeros(rows, dim))

    def forward(self, x, pos):
        out = []
        for i in range(2):
            counter, cache = getattr(self, f"counter{i}"), getattr(self, f"cache{i}")
            counter.copy_(pos[0])
            at = torch.arange(x.shape[0]) + counter
            counter.add_(x.shape[0])
            cache.index_copy_(0, at, x * (i + 1))
            out.append(cache.sum(0))
        return torch.stack(out)


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_position_counters_are_written_in_place_and_match_eager(target):
    """Each counter's update is one element recomputed whole: written in place (no copy
    back after the call), both layers' from one value, and equal to eager's after it."""
    eager, model = CountedCache(), CountedCache()
    x, pos = torch.randn(1, 4), torch.tensor([3])
    exe = kiln.compile(model, (x, pos), target=target)
    assert exe.plan.state_writes == {}, exe.plan.state_writes
    written = {s for r in exe.plan.regions for s in r.inplace.values()}
    assert {"b_counter0", "b_counter1"} <= written, written
    for p in (3, 5):
        x, pos = torch.randn(1, 4), torch.tensor([p])
        got, want = exe(x, pos), eager(x, pos)
        assert rel_err(got, want) < 1e-6
        assert model.counter0.item() == model.counter1.item() == eager.counter0.item() == p + 1


class Smoothed(torch.nn.Module):
    """A four-element state recomputed whole: not one element, so still copied back."""

    def __init__(self):
        super().__init__()
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x):
        self.avg.copy_(self.avg * 0.5 + x)
        return self.avg * 2


def test_a_state_of_several_elements_recomputed_whole_is_copied_back():
    eager, model = Smoothed(), Smoothed()
    x = torch.randn(4)
    exe = kiln.compile(model, (x,), target="interpret")
    assert exe.plan.state_writes, "expected the copy back"
    for _ in range(2):
        x = torch.randn(4)
        assert rel_err(exe(x), eager(x)) < 1e-6
        assert rel_err(model.avg, eager.avg) < 1e-6
