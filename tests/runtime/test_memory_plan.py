"""The memory planner reuses buffers whose lifetimes do not overlap."""

import torch

import kiln
from kiln.runtime.memory_plan import lifetimes


class Chain(torch.nn.Module):
    """A long chain of matmuls: each intermediate dies right after its consumer."""

    def __init__(self, n=6, d=32):
        super().__init__()
        self.ws = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(d, d) / d**0.5)
                                         for _ in range(n))

    def forward(self, x):
        for w in self.ws:
            x = torch.tanh(x @ w)
        return x


def test_chain_reuses_two_slots():
    model = Chain()
    x = torch.randn(8, 32)
    T = kiln.Dim("T", min=1, max=64)
    exe = kiln.compile(model, (x,), dynamic_shapes=({0: T},))
    mem = exe.program.mem
    env = {next(iter(exe.plan.symbols)): 64}
    assert len(mem.slots) <= 2
    assert mem.peak_bytes(env) < mem.total_bytes(env) / 2
    for t in (1, 8, 64):  # the arena is re-laid out per size and stays correct
        x = torch.randn(t, 32)
        torch.testing.assert_close(exe(x), model(x))


def test_no_two_live_values_share_a_slot():
    from kiln.models.llama import example_inputs, tiny_llama

    model = tiny_llama()
    args, dynamic = example_inputs(model.cfg)
    exe = kiln.compile(model, args, dynamic_shapes=dynamic)
    live = lifetimes(exe.plan)
    mem = exe.program.mem
    for slot in mem.slots:
        spans = sorted(live[v] for v in slot.values)
        for (_, e0), (s1, _) in zip(spans, spans[1:]):
            assert e0 < s1, (slot.values, spans)
