"""kiln's topk kernel (codegen/templates/topk.py) against torch.topk: in Triton's
interpreter on fresh random rows of distinct values (several k, widths that are not
powers of two, largest and smallest, a batch of rows, an axis that is not the last,
16-bit and integer inputs, a fused prologue, dynamic rows); NaN, infinities and ties
against a stable sort (ties: lowest index first); what stays torch's op; every
candidate of a router's kernel compiled for sm_90."""

import pytest
import torch

import kiln
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.templates import topk
from kiln.ir.ops import TOPK_MAX_WIDTH
from kiln.ir.plan import RegionKind
from kiln.target import get_target

SM90 = get_target("cuda:sm_90")
ROWS = kiln.Dim("rows", min=1, max=16)


def _distinct(*shape, dtype=torch.float32):
    """Random values, all distinct in `dtype` (a permutation, scaled and shifted)."""
    n = torch.Size(shape).numel()
    return ((torch.randperm(n).float() - n / 2) / 16).reshape(shape).to(dtype)


def _topk_regions(exe):
    return [r for r in exe.plan.regions if r.kind == RegionKind.TOPK]


def _assert_generated(exe, count):
    regions = _topk_regions(exe)
    assert len(regions) == count, [r.kind for r in exe.plan.regions]
    for r in regions:
        kernel = exe.program.kplan.kernels[r.name]
        assert isinstance(kernel, TritonKernel), r.notes


class Routers(torch.nn.Module):
    """Several topks of one [rows, 24] input: a router's groups with its sigmoid and
    bias as prologue, smallest of a row of 37, an axis that is not the last, bf16 and
    int32 rows."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(24))

    def forward(self, x, y, z):
        rows = x.shape[0]
        groups = (x.sigmoid() + self.bias).view(rows, 4, 6)
        gv, gi = groups.topk(2, dim=-1)
        sv, si = y.topk(5, dim=-1, largest=False)
        mv, mi = z.to(torch.bfloat16).topk(4, dim=1)
        iv, ii = (y * 16).to(torch.int32).topk(3, dim=-1, sorted=False)
        return gv, gi, sv, si, mv, mi, iv, ii


def test_topks_match_torch_on_the_interpreter():
    model = Routers()
    args = (_distinct(3, 24), _distinct(3, 37), _distinct(3, 10, 3))
    shapes = ({0: ROWS}, {0: ROWS}, {0: ROWS})
    exe = kiln.compile(model, args, dynamic_shapes=shapes, target="interpret")
    _assert_generated(exe, 4)
    for rows in (1, 5, 16):  # XBLOCK's tail, one row, the bound
        args = (_distinct(rows, 24), _distinct(rows, 37), _distinct(rows, 10, 3))
        got, want = exe(*args), list(model(*args))
        # sorted=False: torch's CPU order is its own; kiln's is sorted, as documented
        want[6], order = want[6].sort(dim=-1, descending=True)
        want[7] = want[7].gather(-1, order)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            if g.is_floating_point():  # the prologue may round a sigmoid an ulp apart
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(g, w)


class SoftmaxRouters(torch.nn.Module):
    """Qwen3-Next's router (an fp32 softmax of bf16 logits, then topk), a max-shifted
    exp normalised by its sum before a topk, and a softmax over another axis than its
    topk's (that one stays a reduction region of its own)."""

    def forward(self, x, z):
        w, i = torch.softmax(x.to(torch.bfloat16), dim=-1, dtype=torch.float32).topk(5)
        e = (x - x.amax(-1, keepdim=True)).exp()
        v, j = (e / e.sum(-1, keepdim=True)).topk(3, largest=False)
        a, b = z.softmax(dim=1).topk(2, dim=-1)
        return w, i, v, j, a, b


def test_softmax_prologues_over_the_topk_rows_fuse():
    model = SoftmaxRouters()
    args = (_distinct(3, 40), _distinct(3, 6, 5))
    exe = kiln.compile(model, args, dynamic_shapes=({0: ROWS}, {0: ROWS}),
                       target="interpret")
    _assert_generated(exe, 3)
    fused = [r for r in _topk_regions(exe)
             if any(op.target in ("aten._softmax.default", "aten.sum.dim_IntList")
                    for op in r.ops)]
    assert len(fused) == 2, [r.ops for r in _topk_regions(exe)]
    assert sum(r.kind == RegionKind.REDUCTION for r in exe.plan.regions) == 1
    for rows in (1, 7):
        args = (_distinct(rows, 40), _distinct(rows, 6, 5))
        for g, w in zip(exe(*args), model(*args)):
            if g.is_floating_point():
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
            else:
                assert torch.equal(g, w)


class Picks(torch.nn.Module):
    def __init__(self, k, largest):
        super().__init__()
        self.k, self.largest = k, largest

    def forward(self, x):
        return x.topk(self.k, dim=-1, largest=self.largest)


@pytest.mark.parametrize("largest", [True, False])
def test_nan_infinities_and_ties_as_a_stable_sort(largest):
    x = torch.tensor([[1.0, float("nan"), 3.0, 3.0, -float("inf"), 1.0, float("inf"), 2.0,
                       float("nan"), -1.0, 3.0],
                      [2.0] * 11,
                      [-float("inf")] * 5 + [5.0] + [-float("inf")] * 5])
    exe = kiln.compile(Picks(9, largest), (x,), target="interpret")
    _assert_generated(exe, 1)
    values, indices = exe(x)
    want_v, want_i = torch.sort(x, dim=-1, descending=largest, stable=True)
    assert torch.equal(values.isnan(), want_v[:, :9].isnan())
    assert torch.equal(values.nan_to_num(), want_v[:, :9].nan_to_num())
    assert torch.equal(indices, want_i[:, :9])


@pytest.mark.parametrize("k,width", [(1, 3), (8, 256), (10, 130)])
def test_widths_and_k_fp16_through_save_and_load(k, width, tmp_path):
    exe = kiln.compile(Picks(k, True), (_distinct(4, width, dtype=torch.float16),),
                       target="interpret")
    exe.save(tmp_path / "topk")
    exe = kiln.load(tmp_path / "topk")
    _assert_generated(exe, 1)
    x = _distinct(4, width, dtype=torch.float16)
    got, want = exe(x), x.topk(k, dim=-1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class Wide(torch.nn.Module):
    def forward(self, x):
        return (x * 2).topk(3, dim=-1).indices, (x * 3).topk(40, dim=-1).values


@pytest.mark.parametrize("target", ["interpret", "cpu"])
def test_large_topks_stay_torch_ops_with_their_producers_apart(target):
    x = _distinct(2, TOPK_MAX_WIDTH + 1)
    exe = kiln.compile(Wide(), (x,), target=target)
    regions = _topk_regions(exe)
    assert len(regions) == 2
    for r in regions:  # only the topk and its results: the multiply is a region of its own
        assert {op.target for op in r.ops} == {"aten.topk.default", "getitem"}, r.ops
        if target == "interpret":
            assert any("kiln generates no topk" in n for n in r.notes), r.notes
    x = _distinct(2, TOPK_MAX_WIDTH + 1)
    got, want = exe(x), Wide()(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_cpu_target_runs_torchs_topk_with_the_prologue():
    model = Routers()
    args = (_distinct(3, 24), _distinct(3, 37), _distinct(3, 10, 3))
    exe = kiln.compile(model, args, target="cpu")
    assert any(op.target == "aten.sigmoid.default" for r in _topk_regions(exe) for op in r.ops)
    for g, w in zip(exe(*args), model(*args)):
        assert torch.equal(g, w)


def _router_spec(experts, k, rows):
    """The topk spec of a [rows, experts] router's picks (sigmoid + bias prologue)."""
    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.randn(experts))

        def forward(self, x):
            return (x.sigmoid() + self.bias).topk(k, dim=-1).indices

    x = torch.randn(rows, experts)
    shapes = ({0: kiln.Dim("rows", min=1, max=rows)},)
    plan = kiln.compile(Router(), (x,), dynamic_shapes=shapes, compile_to="dispatch")
    (region,) = [r for r in plan.regions if r.kind == RegionKind.TOPK]
    return topk.generate(region, plan, SM90)


@pytest.mark.parametrize("experts,k", [(256, 8), (512, 10), (TOPK_MAX_WIDTH, 32)])
def test_router_kernels_compile_for_sm90_without_spills(experts, k):
    """The default and the candidate holding the most keys a thread (all of them with
    KILN_RUN_SLOW=1: no spills on any at these widths, 168 registers at most)."""
    spec = _router_spec(experts, k, 8)
    assert spec.default in spec.configs
    heaviest = max(spec.configs, key=lambda c: c["XBLOCK"] * c["RBLOCK"] / c.num_warps)
    for config in dict.fromkeys([spec.default, heaviest]):
        real = compile_binary(spec, config, SM90).resources
        assert real.spills in (0, None), (config, real)
        assert real.registers is None or real.registers <= 255, (config, real)


@pytest.mark.slow
@pytest.mark.parametrize("experts,k", [(256, 8), (512, 10)])
def test_every_router_candidate_compiles_for_sm90_without_spills(experts, k):
    spec = _router_spec(experts, k, 8)
    for config in spec.configs:
        real = compile_binary(spec, config, SM90).resources
        assert real.spills in (0, None), (config, real)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_router_topks_on_cuda_match_torch(rows):
    """Compiled at 8 rows (an example of 1 would specialise the dim), run at `rows`; z's
    values distinct along the topk's axis in bf16 (the model rounds z to bf16: _distinct
    over 300 rows would tie there, and tied keys' order is no one's)."""
    model = Routers().cuda()

    def make(r):
        z = torch.rand(r, 10, 3).argsort(dim=1).float() / 16 - 0.25
        return _distinct(r, 24).cuda(), _distinct(r, 37).cuda(), z.cuda()
    shapes = ({0: kiln.Dim("rows", min=1, max=512)},) * 3
    exe = kiln.compile(model, make(8), dynamic_shapes=shapes, target="cuda")
    _assert_generated(exe, 4)
    args = make(rows)
    got, want = exe(*args), list(model(*args))
    want[6], order = want[6].sort(dim=-1, descending=True)
    want[7] = want[7].gather(-1, order)
    for g, w in zip(got, want):
        if g.is_floating_point():
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(g, w)
