"""A vocabulary T does not divide, padded to one it does, so it is still cut T ways.

Megatron's answer (make_vocab_size_divisible_by): the embedding table and the LM head
get zero rows up to the next multiple of T, V -> Vp. A lookup never reads them (ids
are < V), and the head's Vp logits are sliced back to V right after its matmul, so the
model computes what it did; each rank holds Vp / T rows instead of a replicated table
(Llama 3's 128256 rows are fine under T=8, but Qwen2's 151936 are not under T=3, and
models with odd vocabularies exist). The slice is where the cut ends: the head's
logits are gathered before it (column_split.py lets such a slice end a cut).

Padded: each weight read only as an embedding table or as LM heads: projections
(permute/t then mm) whose features reach a graph output whole, never regrouped into
heads (so a pipeline stage holding only the head pads it too). A weight with any other
use keeps its size (the rules replicate it, or refuse a head count T does not divide).
The padding rows are not in a checkpoint: `pad_vocab` returns each padded weight's real
row count, so a loader reads only those and zero-fills the rest.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from kiln.ir.graph import KilnGraph, infer_meta
from kiln.ir.ops import op_name

_aten = torch.ops.aten
_WEIGHT_KINDS = ("param", "buffer", "constant")
_TRANSPOSES = ("aten.permute.default", "aten.t.default")


def _rows(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return int(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() == 2 else None


def _head_uses(weight: fx.Node) -> list[fx.Node] | None:
    """The matmuls reading `weight` transposed as their right operand; None if the
    weight has any other use (that is not an embedding lookup)."""
    mms = []
    for u in weight.users:
        name = op_name(u.target)
        if name == "aten.embedding.default" and u.args[0] is weight:
            continue
        if name not in _TRANSPOSES or (name == "aten.permute.default"
                                       and list(u.args[1]) != [1, 0]):
            return None
        for mm in u.users:
            if op_name(mm.target) != "aten.mm.default" or mm.args[1] is not u:
                return None
            mms.append(mm)
    return mms


def _is_logits(mm: fx.Node, rows: int) -> bool:
    """Do the matmul's features reach a graph output whole (through a chain of ops that
    keep them last): a vocabulary's logits, not features regrouped into heads?"""
    node = mm
    for _ in range(64):
        users = list(node.users)
        if any(u.op == "output" for u in users):
            return True
        val = users[0].meta.get("val") if len(users) == 1 else None
        if not isinstance(val, torch.Tensor) or val.dim() == 0 or val.shape[-1] != rows:
            return False
        node = users[0]
    return False


def pad_vocab(kg: KilnGraph, tp: int) -> dict[str, int]:
    """Pad the vocabulary weights whose rows `tp` does not divide; {state name: real rows}."""
    ph = kg.placeholders()
    weights = {s.name: s.target for s in kg.inputs
               if s.kind in _WEIGHT_KINDS and s.target not in kg.mutable}
    tables = {n.args[0] for n in kg.graph.nodes
              if n.op == "call_function" and op_name(n.target) == "aten.embedding.default"}
    padded: dict[str, int] = {}
    for name, target in weights.items():
        node = ph[name]
        rows = _rows(node)
        if rows is None or rows % tp == 0:
            continue
        mms = _head_uses(node)
        if mms is None or not (mms or node in tables) or not all(
                _is_logits(mm, rows) for mm in mms):
            continue
        t = kg.state[target]
        kg.state[target] = torch.cat([t, t.new_zeros(-rows % tp, t.shape[1])])
        node.meta["val"] = kg.fake_mode().from_tensor(kg.state[target], static_shapes=True)
        for u in list(node.users):
            if op_name(u.target) in _TRANSPOSES:
                infer_meta(kg, u)
        for mm in mms:
            infer_meta(kg, mm)
            with kg.graph.inserting_after(mm):
                logits = kg.graph.call_function(_aten.slice.Tensor, (mm, 1, 0, rows))
            mm.replace_all_uses_with(logits, delete_user_cb=lambda u, keep=logits: u is not keep)
            logits.meta.update({k: v for k, v in mm.meta.items() if k != "val"})
            infer_meta(kg, logits)
        padded[target] = rows
    return padded
