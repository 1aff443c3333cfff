"""Generated copy kernels in Triton's interpreter: scatters into state written in place
(only the updated rows; the pointwise prologue fused), functional slice/select
scatters, and gather / concat-only regions."""

import copy

import pytest
import torch

import kiln
from kiln.codegen.select_kernels import TEMPLATES
from kiln.errors import IndexOutOfRangeError
from kiln.ir.plan import RegionKind
from kiln.target import TARGETS
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


def test_overwriting_scatters_are_timed_at_distinct_destination_rows():
    """The tuner fills an overwriting scatter's index inputs with distinct values below
    the indexed dim: at zeros every update row lands on one destination row and the
    output check compares which program stored last (a prefill's K/V write had correct
    candidates judged wrong). An accumulating scatter keeps the default."""
    from kiln.codegen.autotune.timing import buffer_specs, make_buffers
    from kiln.codegen.select_kernels import spec_for

    x, pos, cos = torch.randn(1, 3, 8), torch.arange(3), torch.randn(3, 4)
    exe = compile_interpret(Cache(), (x, pos, cos), ({1: T}, {0: T}, {0: T}))
    plan, fills = exe.plan, []
    for region in (r for r in plan.regions if r.inplace):
        spec = spec_for(region, plan, TARGETS["interpret"])
        fills.append(spec.meta.get("timing_fill"))
        if fills[-1]:
            env = {str(s): 12 for s in plan.symbols}
            ins, _ = make_buffers(buffer_specs(region, plan, env, fills[-1]), "cpu", seed=3)
            (name, how), = fills[-1].items()
            rows = ins[name]
            assert how == {"choose_from": "16"} and rows.shape == (12,)
            assert len(set(rows.tolist())) == 12 and 0 <= int(rows.min()) <= int(rows.max()) < 16
    assert sorted(map(bool, fills)) == [False, True, True]  # index_copy_ and v[pos] = ...


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


# An index outside its dim: eager PyTorch raises; Triton's interpreter would read or
# write host memory past the tensor (a KV cache written past its end aborted the process
# with a double free), so the interpret target checks each loaded index.


class Lookups(torch.nn.Module):
    def forward(self, t, rows, idx, pick):
        # t [5, 3], rows [2], idx [2, 3], pick [2]: index_select and gather refuse
        # negative indices, t[pick] wraps them
        return torch.index_select(t, 0, rows) * 2, torch.gather(t, 0, idx) + 1, t[pick] - 1


def test_gathers_past_their_dim_are_index_errors_on_interpret():
    t, rows, idx = torch.randn(5, 3), torch.tensor([1, 4]), torch.tensor([[0, 4, 1], [3, 2, 0]])
    pick = torch.tensor([-5, 4])
    exe = compile_interpret(Lookups(), (t, rows, idx, pick))
    assert all("tl.device_assert(" in k.spec.source for k in triton_kernels(exe))
    assert_matches(exe(t, rows, idx, pick), Lookups()(t, rows, idx, pick), 1e-6)
    bad = {"index_select": [(torch.tensor([0, 5]), idx, pick), (torch.tensor([-1, 0]), idx, pick)],
           "gather": [(rows, torch.tensor([[0, 4, 5], [0, 0, 0]]), pick),
                      (rows, torch.tensor([[0, 4, 0], [0, -1, 0]]), pick)],
           "index": [(rows, idx, torch.tensor([0, 5])), (rows, idx, torch.tensor([-6, 0]))]}
    line = {"index_select": "torch.index_select", "gather": "torch.gather", "index": "t[pick]"}
    for op, calls in bad.items():
        for args in calls:
            with pytest.raises((IndexError, RuntimeError), match="out of (range|bounds)"):
                Lookups()(t, *args)  # eager's own refusal
            with pytest.raises(IndexOutOfRangeError, match=f"aten.{op}.[a-zA-Z]+ was out") as e:
                exe(t, *args)
            assert "test_copy_kernels.py" in e.value.where and line[op] in e.value.where


def test_gpu_kernels_keep_loaded_indices_inside_their_dims():
    """No check on a GPU (it would cost every call): an index out of range is clamped
    into its dim, so it reads or writes its own tensor, never memory past it."""
    t, rows, idx, pick = (torch.randn(5, 3), torch.tensor([1, 4]),
                          torch.tensor([[0, 4, 1], [3, 2, 0]]), torch.tensor([-5, 4]))
    exe = kiln.compile(Lookups(), (t, rows, idx, pick), target="cuda:sm_90",
                       options={"tune": "none"})
    sources = [k.spec.source for k in triton_kernels(exe)]
    assert sources and not any("tl.device_assert(" in s for s in sources)
    assert sum(s.count("tl.minimum(tl.maximum(") for s in sources) >= 3  # one an index op


class StaticCache(torch.nn.Module):
    """A 16-slot static KV cache written at the decode positions, both ways models do."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, 16, 4))
        self.register_buffer("v", torch.zeros(1, 16, 2, 4))

    def forward(self, x, pos):
        # x [1, 2, T, 4], pos [T]
        self.k.index_copy_(2, pos, x)
        self.v[:, pos] = x.transpose(1, 2) * 2.0
        return self.k.sum(-1) + self.v.sum(-1).transpose(1, 2)


def test_a_cache_write_past_its_end_is_an_index_error_on_interpret():
    model = StaticCache()
    eager = copy.deepcopy(model)
    example = (torch.randn(1, 2, 2, 4), torch.tensor([0, 1]))
    exe = compile_interpret(model, example, ({2: T}, {0: T}))
    for pos in ([0], [15], [3, 4, 5]):  # in range: as eager, state included
        x, pos = torch.randn(1, 2, len(pos), 4), torch.tensor(pos)
        assert_matches(exe(x, pos), eager(x, pos), 1e-6)
    for a, b in zip(model.buffers(), eager.buffers()):
        assert torch.equal(a, b)
    for pos in ([20], [14, 15, 16]):  # past the 16 slots: a kiln error, not a crash
        with pytest.raises(IndexOutOfRangeError, match="out of range") as e:
            exe(torch.randn(1, 2, len(pos), 4), torch.tensor(pos))
        assert "index_copy_" in e.value.where or "self.v[:, pos]" in e.value.where
        assert "KV cache's length" in e.value.hint
    # it still runs after (rewriting the slots a refused call may have partly written)
    x, pos = torch.randn(1, 2, 2, 4), torch.tensor([14, 15])
    assert_matches(exe(x, pos), eager(x, pos), 1e-6)


def test_gpu_targets_carry_no_index_checks():
    """The checks cost every call on a GPU: only the interpret target emits them."""
    lookups = (torch.randn(5, 3), torch.tensor([1, 4]), torch.tensor([[0, 1, 2]] * 2),
               torch.tensor([0, 1]))
    cases = [(Lookups(), lookups, None),
             (StaticCache(), (torch.randn(1, 2, 2, 4), torch.tensor([0, 1])), ({2: T}, {0: T}))]
    for model, args, dims in cases:
        plan = kiln.compile(model, args, dynamic_shapes=dims, compile_to="dispatch")
        regions = [r for r in plan.regions if r.kind in (RegionKind.COPY, RegionKind.POINTWISE)]
        assert regions
        for name, checked in (("interpret", True), ("cuda:sm_90", False)):
            for r in regions:
                spec = TEMPLATES[r.kind](r, plan, TARGETS[name])
                assert ("tl.device_assert(" in spec.source) == checked, (name, spec.source)
