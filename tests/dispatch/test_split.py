"""Region splitting: a prologue fused into attention (RoPE) comes out as a region of its
own; the plan stays valid, both regions say why, and the result still matches eager."""

import torch

import kiln
from kiln.codegen.select_kernels import select_kernels
from kiln.dispatch import split
from kiln.ir.plan import RegionKind, Role
from kiln.ir.printer import print_plan
from kiln.ir.verify import verify_plan
from kiln.models.llama import LlamaConfig
from kiln.pipeline import Context
from kiln.runtime.schedule import schedule
from kiln.runtime.state import state_for_target
from kiln.target import get_target
from tests.codegen.test_attention import AttentionBlock, block_dynamic_shapes, block_inputs
from tests.helpers import rel_err

CFG = LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, max_seq_len=32)


def Block():  # noqa: N802 - reads like the module it builds
    return AttentionBlock(CFG)


def _args(t):
    return block_inputs(CFG, t)


def _plan(model):
    return kiln.compile(model, _args(8), dynamic_shapes=block_dynamic_shapes(CFG),
                        compile_to="dispatch")


def _run(plan, model, target):
    """Codegen and schedule an already formed (here: split) plan, like kiln.compile."""
    tgt = get_target(target)
    ctx = Context(target=tgt, options={"tune": "none"})
    program = schedule(select_kernels(plan, ctx), ctx)
    return kiln.CompiledModule(program, state_for_target(program, dict(model.state_dict()), tgt))


def _attention(plan):
    return next(r for r in plan.regions if r.kind == RegionKind.ATTENTION)


def test_rope_prologue_moves_into_pointwise_regions_before_attention():
    model = Block().eval()
    plan = _plan(model)
    attn = _attention(plan)
    anchor = attn.anchor()
    assert [split.operand_role(anchor, o) for o in split.splittable_operands(attn)] == [
        "query", "key"]
    key = split.split_prologue(plan, attn, split.splittable_operands(attn)[1], "too big")
    query = split.split_prologue(plan, attn, split.splittable_operands(attn)[0], "too big")
    assert verify_plan(plan) == []
    names = [r.name for r in plan.regions]
    assert names.index(key.name) < names.index(attn.name)
    assert names.index(query.name) < names.index(attn.name)
    assert (key.name, query.name) == (f"{attn.name}_key", f"{attn.name}_query")
    assert key.kind == RegionKind.POINTWISE and query.kind == RegionKind.POINTWISE
    for new in (key, query):
        (out,) = new.outputs
        v = plan.values[out]
        assert v.role == Role.TEMP and v.shape == new.op(out).shape
        assert out in attn.inputs
        assert any("too big" in n and attn.name in n for n in new.notes)
    assert sum("split:" in n and "too big" in n for n in attn.notes) == 2
    assert "cos" not in attn.inputs and "sin" not in attn.inputs  # RoPE left attention
    assert split.splittable_operands(attn) == []
    assert "split:" in print_plan(plan)  # what `kiln explain` prints
    for target in ("cpu", "interpret"):
        exe = _run(plan, model, target)
        with torch.no_grad():
            for t in (8, 3):
                a = _args(t)
                assert rel_err(exe(*a), model(*a)) <= 1e-5, (target, t)


def test_operand_without_prologue_is_not_split():
    model = Block()
    plan = _plan(model)
    attn = _attention(plan)
    value = attn.anchor().args[2].name  # only views of the v projection
    before = print_plan(plan)
    assert split.split_prologue(plan, attn, value, "x") is None
    assert print_plan(plan) == before


def test_split_names_never_collide():
    model = Block()
    plan = _plan(model)
    attn = _attention(plan)
    q = split.splittable_operands(attn)[0]
    plan.regions[0].name = f"{attn.name}_query"  # a region already has the natural name
    new = split.split_prologue(plan, attn, q, "x")
    assert new.name == f"{attn.name}_query2"
    assert len({r.name for r in plan.regions}) == len(plan.regions)


def test_a_split_keeps_the_mask_envelope_the_kernel_reads():
    """kiln bench's tiny subject (gpt-fast's mask over a static cache): the attention reads
    its mask's envelope as region inputs no op refers to; a prologue split out of it keeps
    them (they were dropped once: the kernel then walked every key block, 3.6x slower on
    an H200), and the verifier names a region that has lost them."""
    from kiln.bench.subject import PRESETS, build

    s = PRESETS["tiny"].with_(layers=1)
    model = build(s, torch.float32, "cpu")
    seq = kiln.Dim("seq", min=2, max=s.max_len)
    plan = kiln.compile(model, (torch.zeros(1, 16, dtype=torch.long), torch.arange(16)),
                        dynamic_shapes=({1: seq}, {0: seq}), target="interpret",
                        compile_to="dispatch", options={"query_prologue_split": False})
    attn = _attention(plan)
    assert attn.key_bounds and set(attn.key_bound_values()) <= set(attn.inputs)
    (query,) = [o for o in split.splittable_operands(attn)
                if split.operand_role(attn.anchor(), o) == "query"]
    assert split.split_prologue(plan, attn, query, "test") is not None
    assert set(attn.key_bound_values()) <= set(attn.inputs) and verify_plan(plan) == []
    attn.inputs.remove(attn.key_bounds[0])
    assert any("key bounds" in p for p in verify_plan(plan))
