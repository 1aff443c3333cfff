"""Sharding rules for kiln's own ops (kiln.ops): what a rank computes of each.

- gated delta rule: by heads. q, k [B, T, H, K] by key heads, v [B, T, HV, V], g and
  beta [B, T, HV] and the state [N, HV, K, V] by value heads, all in the same number
  of parts: value head j reads key head j // (HV / H), so rank r's block of value
  heads reads exactly its block of key heads.
- latent attention: by query heads; the latent cache (one row per token shared by
  every head) and the positions whole on every rank.
- routed experts: tensor parallel over each expert's intermediate width (gate and up
  cut by rows, down by columns, a partial sum all-reduced after), or, when the experts'
  weights are cut by expert (a seed asks for it), expert parallel: each rank runs its
  experts on every token (the others' ids shifted outside its range, which the op
  drops) and the partial sums are all-reduced.
- fp8 routed experts: the same two ways, each weight's block scales cut with it; a
  width cut must hold whole 128-blocks (h is quantised per 128-group of the width).
- fp8 linear, quantize and scaled mm: column or row parallel like a matmul, the
  128 x 128 block scales cut with their weight. A cut through a block cannot be
  expressed by the scales: it is a ShapeError naming the projection, never a silent
  replication of a (large) fp8 weight.

Each takes the Rules object (its `get`, `committed`, `tp` and `column_parts`).
"""

from __future__ import annotations

import torch.fx as fx

from kiln.errors import ShapeError
from kiln.ir.graph import where
from kiln.ir.ops import bind_args
from kiln.parallel.decision import Decision, replicated, shape
from kiln.parallel.sharding import PARTIAL, REPLICATE, Sharding, shard

FP8_BLOCK = 128  # kiln.ops.fp8_linear.BLOCK: the weights' and activations' scale block


def _heads_cut(s: Sharding, axis: int) -> bool:
    return s.is_shard and s.axis == axis and not s.segments


def gated_delta_rule(rules, node: fx.Node) -> Decision:
    a = bind_args(node)
    q, k, v, g, beta = (a[n] for n in ("q", "k", "v", "g", "beta"))
    state, cu = a.get("initial_state"), a.get("cu_seqlens")
    cut = [(q, 2), (k, 2), (v, 2), (g, 2), (beta, 2)] + ([(state, 1)] if state is not None else [])
    parts = next((s.parts for n, axis in cut if _heads_cut(s := rules.committed(n), axis)),
                 None)
    heads, value_heads = shape(q)[2], shape(v)[2]
    if parts is None or heads % parts or value_heads % parts:
        return replicated(node)
    wants = {n: shard(axis, parts) for n, axis in cut}
    if isinstance(cu, fx.Node):
        wants[cu] = REPLICATE
    return Decision([shard(2, parts), shard(1, parts)], wants)


def latent_attention(rules, node: fx.Node) -> Decision:
    a = bind_args(node)
    q_latent, q_rope = a["q_latent"], a["q_rope"]
    parts = next((s.parts for n in (q_latent, q_rope)
                  if _heads_cut(s := rules.committed(n), 2)), None)
    if parts is None or shape(q_latent)[2] % parts:
        return replicated(node)
    wants = {q_latent: shard(2, parts), q_rope: shard(2, parts)}
    for name in ("kv_latent", "k_rope", "input_pos", "block_table"):
        if isinstance(a.get(name), fx.Node):
            wants[a[name]] = REPLICATE  # one cache row serves every head
    return Decision(shard(2, parts), wants)


def moe_experts(rules, node: fx.Node) -> Decision:
    x, weights, ids, gate, up, down = node.args[:6]
    tp = rules.tp
    experts, inter, _ = shape(gate)
    whole = {x: REPLICATE, weights: REPLICATE, ids: REPLICATE}
    seeded = rules.get(gate)
    if seeded is not None and seeded.is_shard and seeded.axis == 0:
        if seeded.parts != tp or seeded.segments:
            return replicated(node)
        cut = shard(0, tp)
        return Decision(PARTIAL, {**whole, gate: cut, up: cut, down: cut},
                        rewrite="expert_parallel_ids")
    if inter % tp:
        raise ShapeError(
            f"tensor parallelism over {tp} ranks cannot cut the routed experts' "
            f"intermediate size {inter} (of {experts} experts): {inter} is not divisible "
            f"by {tp}", where=where(node),
            hint=f"choose a tp that divides {inter}, or cut the experts by expert "
            f"(expert parallel: tp dividing the {experts} experts)")
    rows = shard(1, tp)
    return Decision(PARTIAL, {**whole, gate: rows, up: rows, down: shard(2, tp)})


def moe_experts_fp8(rules, node: fx.Node) -> Decision:
    """The fp8 experts as moe_experts, each weight's block scales cut with it: by
    expert (a seed asks), or by each expert's intermediate width in whole 128-blocks
    (h is quantised again per 128-wide group of that width for down's product)."""
    x, weights, ids, gate, gate_s, up, up_s, down, down_s = node.args[:9]
    tp = rules.tp
    inter = shape(gate)[1]
    whole = {x: REPLICATE, weights: REPLICATE, ids: REPLICATE}
    seeded = rules.get(gate)
    if seeded is not None and seeded.is_shard and seeded.axis == 0:
        if seeded.parts != tp or seeded.segments:
            return replicated(node)
        cut = shard(0, tp)
        return Decision(PARTIAL, {**whole, **dict.fromkeys((gate, gate_s, up, up_s, down,
                                                            down_s), cut)},
                        rewrite="expert_parallel_ids")
    if not _blocks_whole((inter,), tp):
        raise _block_error(node, "experts' intermediate features", inter, tp, tp)
    rows, cols = shard(1, tp), shard(2, tp)
    return Decision(PARTIAL, {**whole, gate: rows, gate_s: rows, up: rows, up_s: rows,
                              down: cols, down_s: cols})


def _block_error(node: fx.Node, what: str, size: int, parts: int, tp: int) -> ShapeError:
    fits = [t for t in range(1, size + 1) if size % t == 0 and (size // t) % FP8_BLOCK == 0]
    return ShapeError(
        f"tensor parallelism over {tp} ranks would cut this fp8 projection's {size} "
        f"{what} into {parts} parts of {size // parts if size % parts == 0 else size / parts}"
        f", through its {FP8_BLOCK}x{FP8_BLOCK} scale blocks",
        where=where(node),
        hint=f"choose a tp whose parts hold whole {FP8_BLOCK}-wide blocks (here tp in "
        f"{fits or [1]}), or load the model's weights unquantised (keep_fp8=False for "
        "an fp8 checkpoint, no quantize='fp8')")


def _blocks_whole(sizes, parts: int) -> bool:
    return all(n % parts == 0 and (n // parts) % FP8_BLOCK == 0 for n in sizes)


def _fp8_product(rules, node: fx.Node, x: fx.Node, x_scale: fx.Node | None, weight: fx.Node,
                 scale: fx.Node, bias) -> Decision:
    """fp8_linear (x_scale None) or fp8_scaled_mm: y [..., N] = x [..., K] @ w [N, K]^T."""
    tp = rules.tp
    sx, sw = rules.committed(x), rules.get(weight)
    last = len(shape(x)) - 1
    n_out, k_in = shape(weight)
    others = {} if bias is None else {bias: REPLICATE}
    if sx.is_shard and sx.axis == last:  # contraction split: row parallel
        if sx.segments or sx.parts != tp or bias is not None:
            return replicated(node)
        if not _blocks_whole((k_in,), tp):
            raise _block_error(node, "input features", k_in, tp, tp)
        wants = {x: sx, weight: shard(1, tp), scale: shard(1, tp)}
        if x_scale is not None:
            wants[x_scale] = shard(last, tp)
        return Decision(PARTIAL, wants)
    if sx.is_shard:  # rows split (tokens): the weight whole
        wants = {weight: REPLICATE, scale: REPLICATE, **others}
        return Decision(sx, wants)
    whole = {x: REPLICATE} | ({x_scale: REPLICATE} if x_scale is not None else {})
    if sw is None:
        parts, segs = rules.column_parts(node, last)
        if parts > 1 and not _blocks_whole(segs or (n_out,), parts):
            raise _block_error(node, "output features", n_out, parts, tp)
        want = shard(0, parts, segs)
    elif sw.is_shard and sw.axis == 0:
        want = sw
    else:
        return replicated(node)
    if not want.is_shard:
        return replicated(node)
    out = Sharding("shard", last, want.parts, want.segments)
    wants = {**whole, weight: want, scale: Sharding("shard", 0, want.parts, _block_segs(want))}
    if bias is not None:
        wants[bias] = want
    return Decision(out, wants)


def _block_segs(s: Sharding) -> tuple[int, ...] | None:
    return tuple(n // FP8_BLOCK for n in s.segments) if s.segments else None


def fp8_linear(rules, node: fx.Node) -> Decision:
    a = bind_args(node)
    return _fp8_product(rules, node, a["x"], None, a["weight"], a["weight_scale_inv"],
                        a.get("bias"))


def fp8_scaled_mm(rules, node: fx.Node) -> Decision:
    a = bind_args(node)
    return _fp8_product(rules, node, a["xq"], a["x_scale"], a["weight"],
                        a["weight_scale_inv"], a.get("bias"))


def fp8_quantize(rules, node: fx.Node) -> Decision:
    """Per-token groups of 128 along K: a cut of K keeps whole groups or is refused."""
    x = node.args[0]
    s = rules.committed(x)
    last = len(shape(x)) - 1
    if not s.is_shard:
        return replicated(node)
    if s.axis != last:
        return Decision([s, s], {x: s})
    k = shape(x)[last]
    if s.segments or not _blocks_whole((k,), s.parts):
        raise _block_error(node, "input features", k, s.parts, rules.tp)
    return Decision([s, s], {x: s})


RULES = {
    "kiln.gated_delta_rule.default": gated_delta_rule,
    "kiln.latent_attention.default": latent_attention,
    "kiln.moe_experts.default": moe_experts,
    "kiln.moe_experts_fp8.default": moe_experts_fp8,
    "kiln.fp8_linear.default": fp8_linear,
    "kiln.fp8_scaled_mm.default": fp8_scaled_mm,
    "kiln.fp8_quantize.default": fp8_quantize,
}
