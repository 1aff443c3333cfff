"""A prefill attention takes its query's prologue (RoPE) from a region of its own; a decode
attention, a one-op prologue, the CPU target and options={"query_prologue_split": False}
keep it fused. The split plan still matches eager on the interpret target."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.bench.subject import PRESETS, build
from kiln.ir.plan import RegionKind
from tests.codegen.test_attention import AttentionBlock, block_dynamic_shapes, block_inputs
from tests.dispatch.test_split import CFG
from tests.helpers import rel_err


def _regions(exe_or_plan):
    plan = getattr(getattr(exe_or_plan, "program", None), "kplan", None)
    plan = plan.plan if plan is not None else exe_or_plan
    return plan, [r for r in plan.regions if r.kind == RegionKind.ATTENTION]


def _prefill_plan(target, **options):
    block = AttentionBlock(CFG).eval()
    return kiln.compile(block, block_inputs(CFG, 8), dynamic_shapes=block_dynamic_shapes(CFG),
                        target=target, compile_to="dispatch", options=options)


def test_prefill_query_rope_becomes_a_pointwise_region_before_the_attention():
    plan, (attn,) = _regions(_prefill_plan("interpret"))
    names = [r.name for r in plan.regions]
    query = plan.regions[names.index(f"{attn.name}_query")]
    assert names.index(query.name) < names.index(attn.name)
    assert query.kind == RegionKind.POINTWISE
    (q,) = query.outputs
    assert q in attn.inputs
    assert any("prefill tile" in n for n in attn.notes)
    # the key's RoPE stays in the kernel's key loop: only q was measured (NOTES)
    assert any(o.target.startswith("aten.cat") for o in attn.ops)


@pytest.mark.parametrize("target,options", [("cpu", {}),
                                            ("interpret", {"query_prologue_split": False})])
def test_the_cpu_target_and_the_option_keep_the_prologue(target, options):
    plan, (attn,) = _regions(_prefill_plan(target, **options))
    assert not any(r.name.endswith("_query") for r in plan.regions)
    assert sum(o.target.startswith("aten.cat") for o in attn.ops) == 2  # q's and k's RoPE


class Scaled(torch.nn.Module):
    """A one-op query prologue (a scale): nothing to hold in registers, no split."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q * 0.5, k, v, is_causal=True)


def test_a_one_op_prologue_stays_fused():
    T = torch.export.Dim("T", min=2, max=64)
    args = tuple(torch.randn(1, 2, 8, 16) for _ in range(3))
    plan = kiln.compile(Scaled(), args, dynamic_shapes=({2: T},) * 3, target="interpret",
                        compile_to="dispatch")
    assert not any(r.name.endswith("_query") for r in plan.regions)


def test_prefill_runs_split_and_decode_keeps_the_prologue():
    """kiln bench's tiny subject (gpt-fast's layout: a static cache, q's RoPE before SDPA)
    on the interpret target: prefill at two lengths against eager, then a decode step."""
    s = PRESETS["tiny"]
    m = build(s, torch.float32, "cpu")
    seq = kiln.Dim("seq", min=2, max=s.max_len)
    ex = (torch.zeros(1, 16, dtype=torch.long), torch.arange(16))
    pre = kiln.compile(m, ex, dynamic_shapes=({1: seq}, {0: seq}), target="interpret",
                       options={"tune": "none"})
    plan, attns = _regions(pre)
    assert len(attns) == s.layers
    assert all(any(r.name == f"{a.name}_query" for r in plan.regions) for a in attns)
    # the mask's envelope still bounds the key loop (once lost by the split: the kernel
    # walked every key block, 513 us against 143 on an H200 at T 2048)
    assert all(a.key_bounds and set(a.key_bounds) <= set(a.inputs) for a in attns)
    assert all(pre.program.kplan.kernels[a.name].spec.meta["key_bounds"] for a in attns)
    with torch.no_grad():
        for t in (5, 37):
            idx, pos = torch.randint(0, s.vocab, (1, t)), torch.arange(t)
            assert rel_err(pre(idx, pos), m(idx, pos)) <= 1e-5, t
    dec = kiln.compile(m, (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)),
                       target="interpret", compile_to="dispatch")
    assert not any(r.name.endswith("_query") for r in dec.regions)
