"""Generated copy kernels in Triton's interpreter: scatters into state written in place
(only the updated rows; the pointwise prologue fused), functional slice/select
scatters, and gather / concat-only regions."""

import copy

import torch

from kiln.ir.plan import RegionKind
from tests.codegen.gen_helpers import assert_matches, compile_interpret, triton_kernels
from tests.helpers import rel_err

T = torch.export.Dim("T", min=1, max=16)


class Cache(torch.nn.Module):
    """A KV-cache-like state written three ways, with RoPE-style math before the write."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, 16, 4))
        self.register_buffer("v", torch.zeros(16, 2, 4))
        self.register_buffer("acc", torch.zeros(6, 4))

    def forward(self, x, pos, cos):
        # x [1, T, 8], pos [T], cos [T, 4]
        k = x.view(1, -1, 2, 4).transpose(1, 2)
        k1, k2 = k.chunk(2, dim=-1)
        k = k * cos + torch.cat([-k2, k1], dim=-1)  # RoPE of k, fused into the write
        self.k.index_copy_(2, pos, k)
        self.v[pos] = x.view(-1, 2, 4) * 2.0  # index_put_
        self.acc.index_put_((pos % 6,), x[0, :, :4], accumulate=True)
        return x + 1


def test_state_scatters_write_in_place_with_fused_prologue():
    model = Cache()
    eager = copy.deepcopy(model)
    x, pos, cos = torch.randn(1, 3, 8), torch.arange(3), torch.randn(3, 4)
    exe = compile_interpret(model, (x, pos, cos), ({1: T}, {0: T}, {0: T}))
    inplace = [r for r in exe.plan.regions if r.inplace]
    assert len(inplace) == 3 and all(r.kind == RegionKind.COPY for r in inplace)
    start = 0
    for n in (3, 2, 4):
        x, cos = torch.randn(1, n, 8), torch.randn(n, 4)
        pos = torch.arange(start, start + n)
        assert_matches(exe(x, pos, cos), eager(x, pos, cos), 1e-6)
        start += n
    for a, b in zip(model.buffers(), eager.buffers()):
        assert rel_err(a, b) <= 1e-6


class Functional(torch.nn.Module):
    def forward(self, base, src, row, idx):
        # base [T, 6], src [T, 2], row [6]
        return (torch.slice_scatter(base, src, 1, 1, 5, 2),
                torch.select_scatter(base, row, 0, -1) * 2,
                torch.cat([base, base[:, :2]], dim=1), base[idx] + 0)


def test_functional_scatters_select_per_element_and_copies_gather():
    base, src, row = torch.randn(4, 6), torch.randn(4, 2), torch.randn(6)
    idx = torch.tensor([2, 0, -1])
    exe = compile_interpret(Functional(), (base, src, row, idx), ({0: T}, {0: T}, None, None))
    copies = [r for r in exe.plan.regions if r.kind == RegionKind.COPY]
    assert copies and len(triton_kernels(exe)) == len(exe.plan.regions)
    base, src = torch.randn(7, 6), torch.randn(7, 2)
    assert_matches(exe(base, src, row, idx), Functional()(base, src, row, idx), 1e-6)


def test_functional_index_scatter_runs_extern():
    class M(torch.nn.Module):
        def forward(self, base, idx, v):
            return torch.index_put(base, (idx,), v) + 1

    base, idx, v = torch.randn(5, 3), torch.tensor([4, 1]), torch.randn(2, 3)
    exe = compile_interpret(M(), (base, idx, v), require_triton=False)
    scatter = next(r for r in exe.plan.regions if r.kind == RegionKind.COPY)
    assert any("functional" in n for n in scatter.notes), scatter.notes
    assert_matches(exe(base, idx, v), M()(base, idx, v), 1e-6)
