"""Folding an RMSNorm into the decode matmuls that read it (kiln.dispatch.fold_rmsnorm):
which plans fold, which do not, and what the folded plan holds. Plans only (fast); the
kernels' numerics are tests/codegen/test_matmul_rmsnorm.py's."""

import torch
import torch.nn.functional as F

import kiln
from kiln.bench import subject
from kiln.dispatch import split
from kiln.dispatch.group_cache_writes import group_cache_writes_of
from kiln.ir.ops import OpCategory, category
from kiln.ir.plan import RegionKind
from kiln.ir.verify import verify_plan
from kiln.target import GEMV_MAX_M

SM90 = "cuda:sm_90"


class HFNorm(torch.nn.Module):
    """HF Llama's RMSNorm: fp32 statistics, cast back, then times the weight."""

    def __init__(self, dim, eps=1e-6, offset=False, type_as=False):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.eps, self.offset, self.type_as = eps, offset, type_as

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.type_as:  # transformers' Gemma: a cast recorded with layout and device
            return (h * (1.0 + self.weight.float())).type_as(x)
        if self.offset:  # Gemma / Qwen3-Next: the weight is an offset from 1, in fp32
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


class NormLinear(torch.nn.Module):
    def __init__(self, dim=64, n=48, bias=True, offset=False, type_as=False):
        super().__init__()
        self.norm = HFNorm(dim, offset=offset, type_as=type_as)
        self.lin = torch.nn.Linear(dim, n, bias=bias)

    def forward(self, x):
        return self.lin(self.norm(x))


class NormQKV(torch.nn.Module):
    """One norm read by three projections (HF Llama's q, k, v)."""

    def __init__(self, dim=64, kv=32):
        super().__init__()
        self.norm = HFNorm(dim)
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.k = torch.nn.Linear(dim, kv, bias=False)
        self.v = torch.nn.Linear(dim, kv, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.q(h), self.k(h), self.v(h)


class NormSwiGLU(torch.nn.Module):
    """nn.RMSNorm, a fused gate/up projection split by chunk, SwiGLU, the down one."""

    def __init__(self, dim=64, ffn=80):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim, eps=1e-5)
        self.w13 = torch.nn.Linear(dim, 2 * ffn, bias=False)
        self.w2 = torch.nn.Linear(ffn, dim, bias=False)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.1)

    def forward(self, x):
        gate, up = self.w13(self.norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class NormAlsoAdded(torch.nn.Module):
    """The normed value also feeds an add: it must stay a value of its own."""

    def __init__(self, dim=64, n=64):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim, eps=1e-5)
        self.lin = torch.nn.Linear(dim, n, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.lin(h) + h


class NotRowNorm(torch.nn.Module):
    """Look-alikes that are not a row scale: statistics over another dim; an add after
    the scale; a LayerNorm."""

    def __init__(self, kind, dim=64, n=48):
        super().__init__()
        self.kind = kind
        self.lin = torch.nn.Linear(dim, n, bias=False)
        self.ln = torch.nn.LayerNorm(dim)

    def forward(self, x):
        if self.kind == "dim1":
            h = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)
        elif self.kind == "shifted":
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) + 0.5
        else:
            h = self.ln(x)
        return self.lin(h)


def _plan(model, args, target=SM90, dynamic_shapes=None, options=None):
    plan = kiln.compile(model, args, target=target, compile_to="dispatch",
                        dynamic_shapes=dynamic_shapes, options=options)
    assert verify_plan(plan) == []
    return plan


def _reductions(plan):
    return [r for r in plan.regions if r.kind == RegionKind.REDUCTION]


def _folded(plan):
    return [r for r in plan.regions if any(n.startswith("prologue: the RMSNorm") for n in r.notes)]


def _shape(plan):
    return [(r.kind, r.label, sorted(o.target for o in r.ops)) for r in plan.regions]


def test_decode_subject_has_no_norm_region_left():
    """Every norm of the bench subject at decode (two a layer and the final one) is in
    the matmul after it; the plan has that many regions fewer than unfolded."""
    s = subject.PRESETS["tiny"].with_(layers=2)
    model = subject.build(s, torch.float16, "cpu")
    args = (torch.zeros(1, 1, dtype=torch.long), torch.tensor([5]))
    plan, cpu = _plan(model, args), _plan(model, args, target="cpu")
    # the one reduction left computes the causal mask's envelope (dispatch/mask_envelope)
    bounds = {v for r in plan.regions for v in r.key_bound_values()}
    (envelope,) = _reductions(plan)
    assert set(envelope.outputs) == bounds and len(_reductions(cpu)) == 2 * s.layers + 1
    assert all(r.label == "rmsnorm" for r in _reductions(cpu))
    folded = _folded(plan)
    assert len(folded) == 2 * s.layers + 1 and all(r.kind == RegionKind.MATMUL for r in folded)
    # and each layer's K and V cache writes share one region (dispatch/group_cache_writes),
    # which goes into the layer's attention (dispatch/fold_cache_writes); the mask row and
    # the two rotary tables read at the position are recomputed where they are read
    # (dispatch/recompute_cheap)
    assert len(plan.regions) == len(cpu.regions) - (2 * s.layers + 1) + 1 - 2 * s.layers - 3
    for r in folded:  # each holds the norm's one mean beside its product
        assert [category(o.target) for o in r.ops].count(OpCategory.REDUCTION) == 1


def test_prefill_plan_is_unchanged():
    """Many rows take the tiled form (or cuBLAS): the norm stays a region of its own."""
    s = subject.PRESETS["tiny"].with_(layers=1)
    model = subject.build(s, torch.float16, "cpu")
    t = torch.export.Dim("T", min=2, max=s.max_len)
    args = (torch.zeros(1, 16, dtype=torch.long), torch.arange(16))
    dyn = ({1: t}, {0: t})
    # the prefill query's RoPE in a region of its own (dispatch/split_attention_prologues) is
    # the GPU plan's other difference from the CPU's: off here
    same = {"query_prologue_split": False}
    plan = _unbounded(_plan(model, args, dynamic_shapes=dyn, options=same))
    cpu = _plan(model, args, "cpu", dyn)
    group_cache_writes_of(cpu)  # as the GPU plan's K and V writes (not made on the CPU)
    assert _shape(plan) == _shape(cpu) and len(_reductions(plan)) == 3
    static = _unbounded(_plan(model, (torch.zeros(1, GEMV_MAX_M + 1, dtype=torch.long),
                                      torch.arange(GEMV_MAX_M + 1))))
    assert not _folded(static) and len(_reductions(static)) == 3


def _unbounded(plan):
    """The plan less the mask envelope's region (dispatch/mask_envelope: one, before the
    attention), which the CPU target does not make."""
    bounds = {v for r in plan.regions for v in r.key_bound_values()}
    (envelope,) = [r for r in plan.regions if set(r.outputs) == bounds]
    plan.regions.remove(envelope)
    return plan


def test_one_norm_read_by_three_projections_folds_into_each():
    """Folded into each projection, which dispatch/group_siblings.py then groups: one
    region, the norm's ops once (tests/dispatch/test_group_siblings.py)."""
    plan = _plan(NormQKV(), (torch.randn(1, 1, 64),))
    (r,) = _folded(plan)
    assert not _reductions(plan) and len(plan.regions) == 1 and "p_norm_weight" in r.inputs
    assert [category(o.target) for o in r.ops].count(OpCategory.REDUCTION) == 1


def test_norm_with_the_residual_add_before_it_and_swiglu_after_folds():
    plan = _plan(NormSwiGLU(), (torch.randn(1, 1, 64),))
    (r,) = _folded(plan)
    assert {"aten.sigmoid.default", "aten.mean.dim"} <= {o.target for o in r.ops}


def test_norm_read_by_another_op_does_not_fold():
    plan = _plan(NormAlsoAdded(), (torch.randn(1, 1, 64),))
    assert not _folded(plan) and len(_reductions(plan)) == 1


def test_look_alikes_do_not_fold():
    for kind in ("dim1", "shifted", "layernorm"):
        plan = _plan(NotRowNorm(kind), (torch.randn(1, 3, 64),))
        assert not _folded(plan), kind


def test_gemma_offset_weight_folds():
    plan = _plan(NormLinear(offset=True), (torch.randn(1, 1, 64),))
    assert len(_folded(plan)) == 1 and not _reductions(plan)


def test_a_norm_cast_back_with_type_as_folds():
    """`type_as(x)` records the cast with its layout and device (transformers' Gemma
    RMSNorm ends so): still a cast, so a bf16 decode's norm folds (it did not)."""
    model = NormLinear(offset=True, type_as=True).to(torch.bfloat16)
    plan = _plan(model, (torch.randn(1, 1, 64, dtype=torch.bfloat16),))
    assert len(_folded(plan)) == 1 and not _reductions(plan)


def test_cpu_target_keeps_the_norm():
    """The CPU target runs torch ops: a folded norm would only be recomputed."""
    plan = _plan(NormQKV(), (torch.randn(1, 1, 64),), target="cpu")
    assert not _folded(plan) and len(_reductions(plan)) == 1


def test_a_folded_norm_split_back_out_is_a_reduction_again():
    """The resource check's last resort (split the prologue out) gives the norm its own
    reduction region back, and the product a plain one."""
    plan = _plan(NormLinear(), (torch.randn(1, 1, 64),), target="interpret")
    (region,) = plan.regions
    (operand,) = split.splittable_operands(region)
    norm = split.split_prologue(plan, region, operand, "a test")
    assert norm.kind == RegionKind.REDUCTION and verify_plan(plan) == []
    assert not any(category(o.target) == OpCategory.REDUCTION for o in region.ops)
