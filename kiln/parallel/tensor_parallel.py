"""Tensor parallelism, derived: the graph rewritten into one rank's share of the work.

No plan is written per model. Weights start uncut; walking the graph in order, each
op's rule (shard_rules.py) says how it needs its inputs, and an uncut weight takes
what its first consumer asks for. With replicated activations a matmul cuts its
weight's output features (column parallel); a matmul reading features cut that way
cuts its weight's input features and leaves a partial sum (row parallel), which is
all-reduced before any op that is not a view. So Megatron's pattern for a Llama (q, k,
v, gate, up by column; o, down by row; the embedding and LM head by vocabulary; norms
replicated) falls out of the rules, and a model written differently gets whatever the
rules derive, never a wrong answer: an op without a rule gathers its inputs.

Then every view's sizes, head counts included, are rewritten to local ones, weights
and caches replaced by this rank's slices, and shapes inferred again; a check then
makes sure no global size survives. Collectives are `kiln::all_reduce` /
`kiln::all_gather` graph ops on the logical group "tp".
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx

from kiln.errors import VerifierError
from kiln.graph.canonicalize import identity_source
from kiln.ir.graph import KilnGraph, infer_meta, where
from kiln.ir.ops import SPLITS, STRICT_VIEWS, bind_args, norm_axis, op_name
from kiln.ir.symbolic import as_dim
from kiln.ops.collectives import declare_group_size
from kiln.parallel.column_split import column_parts
from kiln.parallel.rank_parts import rank_part
from kiln.parallel.seeds import seed_sharding
from kiln.parallel.shard_rules import Decision, Rules, shape, slice_span
from kiln.parallel.sharding import (
    PARTIAL,
    REPLICATE,
    Sharding,
    block,
    divides,
    local_ranges,
)
from kiln.parallel.view_axes import RESHAPE_TARGETS, map_sharding
from kiln.parallel.vocab_padding import pad_vocab
from kiln.pipeline import as_pass

GROUP = "tp"
_WEIGHT_KINDS = ("param", "buffer", "constant")
_aten = torch.ops.aten


class _Rewriter:
    def __init__(self, kg: KilnGraph, tp: int, rank: int, seeds: dict | None = None):
        self.kg, self.tp, self.rank = kg, tp, rank
        self.seeds = seeds or {}  # state name -> a seed spec (seeds.py)
        self.sh: dict[fx.Node, object] = {}
        self.views_of: dict[fx.Node, list[fx.Node]] = {}  # an uncut weight -> its views
        self.global_shape = {n: shape(n) for n in kg.graph.nodes
                             if isinstance(n.meta.get("val"), torch.Tensor)}
        self.resharded: dict[tuple[fx.Node, Sharding], fx.Node] = {}
        # state name -> (axis, [(start, end), ...]): the ranges of its axis this rank holds
        self.cut: dict[str, tuple[int, list[tuple[int, int]]]] = {}
        self.rules = Rules(self.sh.get, tp, lambda mm, axis: column_parts(mm, tp, axis))

    # -- walking -------------------------------------------------------------------

    def run(self) -> None:
        kinds = {i.name: i.kind for i in self.kg.inputs}
        targets = {i.name: i.target for i in self.kg.inputs}
        for node in list(self.kg.graph.nodes):
            if node.op == "placeholder":
                free = kinds.get(node.name) in _WEIGHT_KINDS
                seeded = free and targets.get(node.name) in self.seeds
                self.sh[node] = None if free else REPLICATE
                if seeded:
                    name = targets[node.name]
                    self.sh[node] = seed_sharding(name, self.global_shape[node],
                                                  self.seeds[name], self.tp)
                elif free:
                    self.views_of[node] = []
            elif node.op == "call_function":
                self.visit(node)
            elif node.op == "output":
                self.outputs(node)
        for root, s in list(self.sh.items()):
            if s is None and root.op == "placeholder":
                self.sh[root] = REPLICATE

    def visit(self, node: fx.Node) -> None:
        d: Decision = self.rules.decide(node)
        if d.out is None:  # a view of an uncut weight
            root = self.root_of(node)
            self.views_of[root].append(node)
            self.sh[node] = None
            return
        for inp, want in d.wants.items():
            self.give(node, inp, want)
        self.sh[node] = d.out
        if d.rewrite == "vocab_parallel_embedding":
            self.vocab_parallel_embedding(node)
        elif d.rewrite == "expert_parallel_ids":
            self.expert_parallel_ids(node)

    def root_of(self, node: fx.Node) -> fx.Node:
        while node.op != "placeholder":
            node = node.args[0]
        return node

    def give(self, consumer: fx.Node, inp: fx.Node, want: Sharding) -> None:
        """Make `consumer` read `inp` sharded as `want`: cut a weight, or reshard."""
        if self.sh.get(inp) is None:
            self.commit(inp, want)
        have = self.sh[inp]
        if have != want:
            consumer.replace_input_with(inp, self.reshard(inp, have, want, consumer))

    def commit(self, node: fx.Node, want: Sharding) -> None:
        """Cut an uncut weight so that its view `node` is sharded as `want` (or
        replicate it when the views cannot carry the cut back to the weight)."""
        path = []
        while node.op != "placeholder":
            path.append(node)
            node = node.args[0]
        s = want
        for view in path:
            s = map_sharding(view, s, forward=False) if s is not None else None
        root_shape = self.global_shape[node]
        if s is None or (s.is_shard and not divides(root_shape[s.axis], s)):
            s = REPLICATE
        self.sh[node] = s
        for view in self.views_of.pop(node, []):
            src = self.sh[view.args[0]]
            mapped = map_sharding(view, src)
            if mapped is None:
                view.replace_input_with(view.args[0],
                                        self.reshard(view.args[0], src, REPLICATE, view))
                mapped = REPLICATE
            self.sh[view] = mapped

    def outputs(self, node: fx.Node) -> None:
        kinds = [o.kind for o in self.kg.outputs]
        values = list(node.args[0])
        for i, (v, kind) in enumerate(zip(values, kinds)):
            s = self.sh.get(v, REPLICATE) or REPLICATE
            if kind in ("user", "send") and s != REPLICATE:  # a receiver expects it whole
                values[i] = self.reshard(v, s, REPLICATE, node)
        node.args = (tuple(values),)

    # -- inserting ops ---------------------------------------------------------------

    def add(self, before: fx.Node, target, *args, like: fx.Node) -> fx.Node:
        with self.kg.graph.inserting_before(before):
            new = self.kg.graph.call_function(target, args)
        if "stack_trace" in like.meta:
            new.meta["stack_trace"] = like.meta["stack_trace"]
        new.meta["val"] = like.meta.get("val")  # global until shapes are inferred again
        return new

    def reshard(self, node: fx.Node, have, want: Sharding, before: fx.Node) -> fx.Node:
        key = (node, want)
        if key in self.resharded:
            return self.resharded[key]
        x = node
        if have == PARTIAL:
            x = self.add(before, torch.ops.kiln.all_reduce.default, x, GROUP, like=node)
            have = REPLICATE
        if have != want and have.is_shard:
            if want.is_shard and _finer(have, want):
                x = self.local_slice(x, node, have, want, before)
                have = want
            else:
                x = self.gather(x, node, have, before)
                have = REPLICATE
        if have != want:
            x = self.local_slice(x, node, REPLICATE, want, before)
        self.resharded[key] = x
        return x

    def local_slice(self, x, node, have: Sharding, want: Sharding, before) -> fx.Node:
        """This rank's part of `want` out of what it holds as `have` (no communication)."""
        size = self.global_shape[node][want.axis]
        held = (local_ranges(size, have, self.tp, self.rank) if have.is_shard
                else [(0, size)])
        pieces = []
        for a, b in local_ranges(size, want, self.tp, self.rank):
            offset = 0
            for ha, hb in held:
                if ha <= a and b <= hb:
                    pieces.append(self.add(before, _aten.slice.Tensor, x, want.axis,
                                           offset + a - ha, offset + b - ha, like=node))
                    break
                offset += hb - ha
        if len(pieces) == 1:
            return pieces[0]
        return self.add(before, _aten.cat.default, pieces, want.axis, like=node)

    def gather(self, x, node, have: Sharding, before) -> fx.Node:
        """The whole tensor from every rank's part (an all-gather along the cut axis)."""
        size = self.global_shape[node][have.axis]
        full = Sharding("shard", have.axis, self.tp, have.segments)
        if have.parts != self.tp:
            x = self.local_slice(x, node, have, full, before)
        x = self.add(before, torch.ops.kiln.all_gather.default, x, have.axis, GROUP, like=node)
        if not have.segments:
            return x
        # rank-major [r0: seg0 seg1 | r1: seg0 seg1] -> segment-major [seg0 r0 r1 | seg1 ..]
        local = [n // self.tp for n in have.segments]
        pieces = []
        for k, n in enumerate(local):
            for r in range(self.tp):
                start = r * sum(local) + sum(local[:k])
                pieces.append(self.add(before, _aten.slice.Tensor, x, have.axis, start,
                                       start + n, like=node))
        assert sum(have.segments) == size
        return self.add(before, _aten.cat.default, pieces, have.axis, like=node)

    def vocab_parallel_embedding(self, node: fx.Node) -> None:
        """Each rank looks up the ids in its slice of the vocabulary, zeros the rest;
        the all-reduce its consumers insert sums the slices."""
        weight, ids = node.args[:2]
        vocab = self.global_shape[weight][0]
        rows = vocab // self.tp
        lo = block(self.tp, self.tp, self.rank) * rows
        shifted = self.add(node, _aten.sub.Tensor, ids, lo, like=ids)
        inside = self.add(node, _aten.logical_and.default,
                          self.add(node, _aten.ge.Scalar, shifted, 0, like=ids),
                          self.add(node, _aten.lt.Scalar, shifted, rows, like=ids), like=ids)
        safe = self.add(node, _aten.mul.Tensor, shifted, inside, like=ids)
        node.replace_input_with(ids, safe)
        with self.kg.graph.inserting_after(node):
            mask = self.kg.graph.call_function(_aten.unsqueeze.default, (inside, -1))
        with self.kg.graph.inserting_after(mask):
            masked = self.kg.graph.call_function(_aten.mul.Tensor, (node, mask))
        node.replace_all_uses_with(masked, delete_user_cb=lambda u: u is not masked)
        for n in (mask, masked):
            n.meta["val"] = node.meta["val"]
            if "stack_trace" in node.meta:
                n.meta["stack_trace"] = node.meta["stack_trace"]
        self.global_shape[masked] = self.global_shape[node]
        self.sh[mask] = REPLICATE
        self.sh[masked] = PARTIAL
        self.sh[node] = PARTIAL

    def expert_parallel_ids(self, node: fx.Node) -> None:
        """This rank holds experts [lo, lo + E / T): ids shifted by lo, so its experts
        are 0.. and every other expert's id falls outside, where kiln::moe_experts drops
        the pair; the all-reduce its consumers insert sums the ranks' experts."""
        ids = node.args[2]
        local = self.global_shape[node.args[3]][0] // self.tp
        lo = block(self.tp, self.tp, self.rank) * local
        node.replace_input_with(ids, self.add(node, _aten.sub.Tensor, ids, lo, like=ids))

    # -- local sizes -------------------------------------------------------------------

    def localize(self) -> None:
        """Sizes in view/expand/split/slice arguments, weights and caches made local."""
        for node in self.kg.graph.nodes:
            s = self.sh.get(node)
            if node.op == "call_function" and isinstance(s, Sharding) and s.is_shard:
                self.local_args(node, s)
            elif node.op == "call_function" and op_name(node.target) in SPLITS:
                self.local_split(node)
        targets = {i.name: i.target for i in self.kg.inputs if i.kind in _WEIGHT_KINDS}
        for node in self.kg.graph.nodes:
            s = self.sh.get(node)
            if node.op == "placeholder" and node.name in targets and s.is_shard:
                name = targets[node.name]
                t = rank_part(self.kg.state[name], s, self.tp, self.rank,
                              private=name in self.kg.mutable)
                size = self.global_shape[node][s.axis]
                self.cut[name] = (s.axis, local_ranges(size, s, self.tp, self.rank))
                self.kg.state[name] = t
                node.meta["val"] = self.kg.fake_mode().from_tensor(t, static_shapes=True)

    def local_args(self, node: fx.Node, s: Sharding) -> None:
        name = op_name(node.target)
        if name in RESHAPE_TARGETS or name == "aten.expand.default":
            sizes = list(node.args[1])
            if isinstance(sizes[s.axis], int) and sizes[s.axis] != -1:
                sizes[s.axis] //= s.parts
            node.args = (node.args[0], sizes, *node.args[2:])
        elif name == "aten.slice.Tensor":
            src = self.sh.get(node.args[0])
            dim = norm_axis(bind_args(node)["dim"], len(self.global_shape[node.args[0]]))
            if isinstance(src, Sharding) and src.segments and src.axis == s.axis == dim:
                start, end = slice_span(node, self.global_shape[node.args[0]][s.axis])
                args = list(node.args) + [0, None, None][len(node.args) - 1:]
                args[2], args[3] = start // s.parts, end // s.parts
                node.args = tuple(args)

    def local_split(self, node: fx.Node) -> None:
        src = self.sh.get(node.args[0])
        if not (isinstance(src, Sharding) and src.is_shard and src.segments):
            return
        dim = norm_axis(bind_args(node).get("dim", 0), len(self.global_shape[node.args[0]]))
        if dim == src.axis and isinstance(node.args[1], (list, tuple)):
            node.args = (node.args[0], [n // src.parts for n in node.args[1]], *node.args[2:])

    def infer_shapes(self) -> None:
        """Every op's shapes again, from the local inputs. Guards are suppressed: a fake
        op comparing a size symbol with its example value must not specialise the
        sequence dim (torch 2.11's do), since the symbols were already checked at export."""
        env = self.kg.fake_mode().shape_env
        before = dict(env.replacements) if env is not None else {}
        with env.suppress_guards() if env is not None else contextlib.nullcontext():
            self.infer_all()
        if env is not None:
            fixed = {s: v for s, v in env.replacements.items()
                     if before.get(s) != v and getattr(v, "is_number", False)}
            if fixed:
                raise VerifierError(
                    f"tensor parallelism specialised size symbols {fixed} on rank {self.rank}",
                    hint="this is a kiln bug; rerun with KILN_DUMP_IR=<dir> and report")

    def infer_all(self) -> None:
        for node in self.kg.graph.nodes:
            if node.op == "call_function":
                try:
                    self.infer(node)
                except Exception as e:  # noqa: BLE001 - reported as the kiln bug it is
                    raise VerifierError(
                        f"tensor parallelism left {node.name} ({op_name(node.target)}) with "
                        f"inconsistent local shapes on rank {self.rank}: {e}",
                        where=where(node),
                        hint="this is a kiln bug; rerun with KILN_DUMP_IR=<dir> and report "
                        "the dumps") from e

    def infer(self, node: fx.Node) -> None:
        """Shapes from the op (a kiln `view` is a logical reshape, so it is inferred as
        one), checked against the value's global shape cut as its sharding says: a
        static size that differs is a global size that survived. The value then gets
        that expected shape, symbolic sizes included, whatever the fake op concluded."""
        target = node.target
        if op_name(target) in STRICT_VIEWS:
            node.target = _aten.reshape.default
        try:
            infer_meta(self.kg, node)
        finally:
            node.target = target
        s = self.sh.get(node)
        val = node.meta["val"]
        if node not in self.global_shape or not isinstance(s, Sharding) \
                or not isinstance(val, torch.Tensor):
            return
        want = list(self.global_shape[node])
        if s.is_shard:
            want[s.axis] = want[s.axis] // s.parts
        got = [as_dim(d) for d in val.shape]  # symbolic compare: no guards
        if len(got) != len(want) or any(isinstance(w, int) and isinstance(g, int) and g != w
                                         for g, w in zip(got, want)):
            raise VerifierError(
                f"{node.name} on rank {self.rank} has shape {got}; sharded as {s} it "
                f"should be {[as_dim(w) for w in want]} (a global size survived)",
                where=where(node),
                hint="this is a kiln bug; rerun with KILN_DUMP_IR=<dir> and report")
        with self.kg.fake_mode():
            node.meta["val"] = torch.empty(want, dtype=val.dtype, device=val.device)


def _drop_identities(kg: KilnGraph) -> None:
    """Views that local sizes made identities (one KV head of [.., 1, D] viewed as
    itself) go, as canonicalize would have removed them (`no-identity-views`)."""
    for node in list(kg.graph.nodes):
        if node.op == "call_function":
            src = identity_source(kg, node)
            if src is not None:
                node.replace_all_uses_with(src)
                kg.graph.erase_node(node)


def _finer(have: Sharding, want: Sharding) -> bool:
    return (have.axis == want.axis and have.segments == want.segments
            and want.parts % have.parts == 0)


def _drop_unread_weights(kg: KilnGraph) -> None:
    """Weights this plan never reads leave it, so no rank holds them whole (DeepSeek-V3's
    decode reads W_UK / W_UV, not the kv_b_proj they came from, which its prefill cuts
    by heads). The model still owns them."""
    kinds = {i.name: i for i in kg.inputs}
    for node in list(kg.graph.nodes):
        spec = kinds.get(node.name)
        if node.op == "placeholder" and not node.users and spec is not None \
                and spec.kind in _WEIGHT_KINDS and spec.target not in kg.mutable:
            kg.inputs = [i for i in kg.inputs if i.name != node.name]
            kg.graph.erase_node(node)


def _split_addmm(kg: KilnGraph) -> None:
    """addmm -> mm + add, so a row-parallel bias is added once, after the sum."""
    for node in list(kg.graph.nodes):
        if node.op == "call_function" and op_name(node.target) == "aten.addmm.default":
            if node.kwargs or len(node.args) != 3:
                continue
            bias, a, b = node.args
            with kg.graph.inserting_before(node):
                mm = kg.graph.call_function(_aten.mm.default, (a, b))
                add = kg.graph.call_function(_aten.add.Tensor, (mm, bias))
            for n in (mm, add):
                n.meta.update({k: v for k, v in node.meta.items() if k != "val"})
                infer_meta(kg, n)
            node.replace_all_uses_with(add)
            kg.graph.erase_node(node)


def _in_checkpoint(cuts: dict, real_rows: dict[str, int]) -> dict:
    """The cuts as a checkpoint holds them: a padded vocabulary's ranges end at its real
    rows (a loader zero-fills the rest of the rank's slice)."""
    out = dict(cuts)
    for name, rows in real_rows.items():
        if name in out and out[name][0] == 0:
            out[name] = (0, [(min(a, rows), min(b, rows)) for a, b in out[name][1]])
    return out


@as_pass
def tensor_parallel(kg: KilnGraph, ctx) -> KilnGraph:
    cfg = ctx.options.get("parallel")
    if cfg is None or cfg.tp == 1:
        return kg
    declare_group_size(GROUP, cfg.tp)
    _split_addmm(kg)
    real_rows = pad_vocab(kg, cfg.tp)
    rewriter = _Rewriter(kg, cfg.tp, cfg.tp_rank, ctx.options.get("tp_seeds"))
    _drop_unread_weights(kg)
    rewriter.run()
    rewriter.localize()
    rewriter.infer_shapes()
    _drop_identities(kg)
    ctx.options["weight_cuts"] = _in_checkpoint(rewriter.cut, real_rows)
    kg.recompile()
    return kg

