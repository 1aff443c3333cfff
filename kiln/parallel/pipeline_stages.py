"""Pipeline stages: every op gets a stage, and this rank keeps only its own stage's ops.

Why it is shaped this way:
- Stages are contiguous runs of layers, so activations flow one way (stage s sends
  only to later stages) and each boundary is one small hidden-state tensor.
- A layer is a numbered weight group (`model.layers.3.` -> "model.layers.3"), torch's
  ModuleList naming: any model with a layer list splits, no per-model table. Runs are
  balanced by weight bytes (memory is what a stage runs out of), or `pp_split` counts.
- An op's stage is the max of the stages of what it reads: a monotone fixed point that
  one pass in topological order reaches. Ops that read nothing staged (position ids,
  masks, RoPE lookups) "float": each stage that needs them computes its own copy, which
  is cheaper than a send and keeps stages independent.
- Values crossing a boundary are not graph ops: they become placeholders of kind "recv"
  and outputs of kind "send", which the runtime's stage runner moves with p2p.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from kiln.errors import ArgumentError, UnsupportedOpError
from kiln.ir.graph import GraphInput, GraphOutput, KilnGraph, where
from kiln.parallel.affinity import affinity
from kiln.pipeline import as_pass

_WEIGHT_KINDS = ("param", "buffer", "constant")
_NUMBER = re.compile(r"^\d+$")


@dataclass
class StageIO:
    """This rank's part of a pipeline: its stage, what it receives and what it sends.

    Both lists are in graph order, so the values stage a sends to stage d (in `send`
    order) are the values d receives from a (in `recv` order): p2p needs no names.
    """

    stage: int
    num_stages: int
    layers: list[list[str]]  # per stage, the layer groups it holds
    weight_bytes: list[int]  # per stage, the bytes of the weights it holds
    recv: list[tuple[str, int]] = field(default_factory=list)  # (value, source stage)
    send: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # (value, dsts)


def layer_group(target: str) -> str | None:
    """`model.layers.3.mlp.weight` -> "model.layers.3"; None without a numeric component."""
    parts = target.split(".")
    for i, p in enumerate(parts[:-1]):
        if _NUMBER.match(p):
            return ".".join(parts[: i + 1])
    return None


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def split_layers(sizes: list[int], parts: int) -> list[int]:
    """Layer counts per stage: contiguous runs minimising the largest run's bytes."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[p][i]: the smallest max-run bytes splitting the first i layers into p runs
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for p in range(1, parts + 1):
        for i in range(p, n + 1):
            for j in range(p - 1, i):
                cost = max(best[p - 1][j], prefix[i] - prefix[j])
                if cost < best[p][i]:
                    best[p][i], cut[p][i] = cost, j
    counts, i = [], n
    for p in range(parts, 0, -1):
        counts.append(i - cut[p][i])
        i = cut[p][i]
    return counts[::-1]


class _Stages:
    def __init__(self, kg: KilnGraph, pp: int, split: tuple[int, ...] | None):
        self.kg = kg
        self.pp = pp
        self.order = {n: i for i, n in enumerate(kg.graph.nodes)}
        self.specs = {s.name: s for s in kg.inputs}
        self.static = _static(kg)
        self._group_weights()
        self._assign_layers(split)

    def _first_use(self, node: fx.Node) -> int | None:
        """Where the activations first meet this weight: its first user that reads
        something other than weights. Ops on weights alone (a transpose, DeepSeek's
        absorbed W_UK / W_UV) may sit anywhere in the graph (export hoists them to the
        top), so they are looked through, not taken as the use. None: never used with
        activations (DeepSeek's W_UK in a prefill module, which takes the expanded form)."""
        seen, todo, found = set(), list(node.users), None
        while todo:
            u = todo.pop()
            if u in seen or u.op == "output":
                continue
            seen.add(u)
            if u in self.static:
                todo.extend(u.users)
            else:
                found = self.order[u] if found is None else min(found, self.order[u])
        return found

    def _group_weights(self) -> None:
        """Layer groups in graph order, and each staged weight's group."""
        ph = self.kg.placeholders()
        self.group_of: dict[str, str] = {}
        first: dict[str, int] = {}
        loose: list[fx.Node] = []
        for s in self.kg.inputs:
            if s.kind not in _WEIGHT_KINDS or s.target in self.kg.mutable:
                continue
            g = layer_group(s.target)
            node = ph[s.name]
            if g is None:
                if s.kind == "param":
                    loose.append(node)  # unnumbered buffers/constants float
                continue
            self.group_of[s.name] = g
            pos = self._first_use(node)
            first[g] = min(first.get(g, 1 << 62), 1 << 62 if pos is None else pos)
        # a layer none of whose weights meet the activations keeps its name's order
        self.layers = sorted(first, key=lambda g: (first[g], self.order[ph[next(
            n for n, h in self.group_of.items() if h == g)]]))
        if not self.layers:
            raise ArgumentError(
                "pipeline parallelism needs a layer list, and this model's weights have no "
                "numbered module group (like model.layers.0)",
                hint="hold the layers in an nn.ModuleList, or use parallel={'pp': 1}")
        starts = [first[g] for g in self.layers]
        for node in loose:  # with the first layer after it, else the last one before it
            pos = self._first_use(node)
            if pos is None:
                continue  # never meets the activations: it floats
            after = [g for g, s in zip(self.layers, starts) if s >= pos]
            self.group_of[node.name] = after[0] if after else self.layers[-1]

    def _assign_layers(self, split: tuple[int, ...] | None) -> None:
        n = len(self.layers)
        if self.pp > n:
            raise ArgumentError(
                f"pipeline parallelism over {self.pp} stages needs at least {self.pp} layers, "
                f"the model has {n} ({self.layers[0]} .. {self.layers[-1]})",
                hint=f"use at most pp={n} (or tensor parallelism for the rest)")
        sizes = {g: 0 for g in self.layers}
        for name, g in self.group_of.items():
            sizes[g] += _nbytes(self.kg.state.get(self.specs[name].target))
        if split is None:
            counts = split_layers([sizes[g] for g in self.layers], self.pp)
        elif sum(split) != n:
            raise ArgumentError(
                f"parallel['pp_split'] {list(split)} gives {sum(split)} layers, the model has {n}",
                hint="give one layer count per stage, summing to the number of layers")
        else:
            counts = list(split)
        self.stage_bytes = []  # the staged weights' bytes per stage (clones not counted)
        self.stage_layers: list[list[str]] = []
        self.layer_stage: dict[str, int] = {}
        i = 0
        for s, c in enumerate(counts):
            self.stage_layers.append(self.layers[i: i + c])
            self.stage_bytes.append(sum(sizes[g] for g in self.layers[i: i + c]))
            for g in self.layers[i: i + c]:
                self.layer_stage[g] = s
            i += c

    def assign(self) -> dict[fx.Node, int | None]:
        """Each node's stage; None for floating nodes (read nothing staged)."""
        stage: dict[fx.Node, int | None] = {}
        for node in self.kg.graph.nodes:
            if node.op == "placeholder":
                g = self.group_of.get(node.name)
                stage[node] = None if g is None else self.layer_stage[g]
            elif node.op != "output":
                ins = [stage[a] for a in node.all_input_nodes if stage[a] is not None]
                stage[node] = max(ins) if ins else None
        return stage


def _static(kg: KilnGraph) -> set[fx.Node]:
    """Weights, and ops that read only weights and constants (a transposed tied
    embedding, DeepSeek's absorbed attention weights)."""
    kinds = {s.name: s for s in kg.inputs}
    static: set[fx.Node] = set()
    for node in kg.graph.nodes:
        if node.op == "placeholder":
            spec = kinds[node.name]
            if spec.kind in _WEIGHT_KINDS and spec.target not in kg.mutable:
                static.add(node)
        elif node.op != "output" and all(a in static for a in node.all_input_nodes):
            static.add(node)
    return static


def _movable(kg: KilnGraph, stage: dict) -> set[fx.Node]:
    """Nodes a stage may compute (or hold) for itself: floating ones (no stage), and the
    static ones. Weights are cloned to the stages that read them, not sent."""
    return _static(kg) | {n for n in kg.graph.nodes if n.op != "output" and stage[n] is None}


def _needed_on(kg: KilnGraph, stage: dict, movable: set, consumers: dict) -> None:
    """Walk backward: a movable node is needed on every stage that reads it."""
    for node in reversed(kg.graph.nodes):
        if node.op == "output":
            continue
        here = consumers.get(node, set()) if node in movable else {stage[node]}
        for a in node.all_input_nodes:
            if a in movable:
                consumers.setdefault(a, set()).update(here)


@as_pass
def pipeline_stages(kg: KilnGraph, ctx) -> KilnGraph:
    cfg = ctx.options.get("parallel")
    if cfg is None or cfg.pp == 1:
        return kg
    plan = _Stages(kg, cfg.pp, cfg.pp_split)
    stage = plan.assign()
    me, last = cfg.pp_rank, cfg.pp - 1
    outs = kg.output_values()
    # the stage that owns each output: user outputs the last, a mutation its writer's
    out_stage = []
    for spec, node in zip(kg.outputs, outs):
        s = stage.get(node) if isinstance(node, fx.Node) else None
        out_stage.append(last if spec.kind == "user" else (s if s is not None else 0))
    movable = _movable(kg, stage)
    # which stages need each value: weights cloned to each, pins checked (affinity.py)
    placement = {n: (None if n in movable else stage[n]) for n in kg.graph.nodes
                 if n.op == "call_function"}
    ctx.options["affinity"] = affinity(kg, placement, ctx.options.get("pins"))
    floating_uses: dict[fx.Node, set[int]] = {}
    for node, s in zip(outs, out_stage):
        if isinstance(node, fx.Node) and node in movable:
            floating_uses.setdefault(node, set()).add(s)
    _needed_on(kg, stage, movable, floating_uses)
    for spec in kg.inputs:  # a KV cache is state: one stage holds it
        if spec.target in kg.mutable:
            node = kg.placeholders()[spec.name]
            if len(floating_uses.get(node, set())) > 1:
                raise UnsupportedOpError(
                    f"buffer {spec.target} is updated in place and read on pipeline stages "
                    f"{sorted(floating_uses[node])}; one stage must own it",
                    where=where(next(iter(node.users))), hint="use parallel={'pp': 1}")

    def kept(n: fx.Node) -> bool:
        if n.op == "placeholder" and n.name in plan.specs and plan.specs[n.name].kind in (
                "user", "user_const", "user_size"):
            return True
        if n in movable:
            return me in floating_uses.get(n, set())
        return stage[n] == me

    keep = {n for n in kg.graph.nodes if n.op != "output" and kept(n)}
    # consumers on later stages (and outputs they own) of values produced here
    dsts: dict[fx.Node, set[int]] = {}
    for n in kg.graph.nodes:
        if n.op == "output" or n in movable:
            continue
        for a in n.all_input_nodes:
            if a not in movable and stage[a] < stage[n]:
                dsts.setdefault(a, set()).add(stage[n])
    for node, s in zip(outs, out_stage):
        if isinstance(node, fx.Node) and node not in movable and stage[node] < s:
            dsts.setdefault(node, set()).add(s)

    graph = kg.graph
    # values from earlier stages read here become "recv" placeholders
    wanted = [a for a in graph.nodes if a not in keep and stage.get(a) is not None
              and stage[a] < me and me in dsts.get(a, set())]
    last_ph = [n for n in graph.nodes if n.op == "placeholder"][-1]
    recvs: dict[fx.Node, fx.Node] = {}
    new_inputs: list[GraphInput] = []
    for a in wanted:
        if not isinstance(a.meta.get("val"), torch.Tensor):
            raise UnsupportedOpError(
                f"%{a.name} ({type(a.meta.get('val')).__name__}) crosses from pipeline stage "
                f"{stage[a]} to {me}; only tensors are sent between stages",
                where=where(a), hint="use parallel={'pp': 1}")
        with graph.inserting_after(last_ph):
            ph = graph.placeholder(f"recv_{a.name}")
        ph.meta["val"] = a.meta["val"]
        last_ph = ph
        recvs[a] = ph
        new_inputs.append(GraphInput(ph.name, "recv", target=a.name, stage=stage[a]))
        a.replace_all_uses_with(ph, delete_user_cb=lambda u: u in keep)
    # outputs: this stage's mutations, then its sends, then (last stage) the user outputs
    out_node = kg.output_node()
    values, specs = [], []
    for spec, node, s in zip(kg.outputs, outs, out_stage):
        if spec.kind != "user" and s == me:
            values.append(recvs.get(node, node))
            specs.append(spec)
    send = []
    for n in graph.nodes:
        if n in keep and stage.get(n) == me and any(d > me for d in dsts.get(n, ())):
            to = tuple(sorted(d for d in dsts[n] if d > me))
            values.append(n)
            specs.append(GraphOutput(n.name, "send", stages=to))
            send.append((n.name, to))
    if me == last:
        for spec, node in zip(kg.outputs, outs):
            if spec.kind == "user":
                values.append(recvs.get(node, node))
                specs.append(spec)
    out_node.args = (tuple(values),)
    for n in reversed(list(graph.nodes)):
        if n.op != "output" and n not in keep and n not in recvs.values():
            graph.erase_node(n)
    alive = {n.name for n in graph.nodes if n.op == "placeholder"}
    kg.inputs = [s for s in kg.inputs if s.name in alive] + new_inputs
    for spec, node in zip(specs, values):
        spec.name = node.name
    kg.outputs = specs
    targets = {s.target for s in kg.inputs if s.kind in _WEIGHT_KINDS}
    for k in [k for k in kg.state if k not in targets]:  # in place: kiln.compile holds it
        del kg.state[k]
    kg.mutable = {m for m in kg.mutable if m in targets}
    kg.stage_io = StageIO(me, cfg.pp, plan.stage_layers, plan.stage_bytes,
                          [(recvs[a].name, stage[a]) for a in wanted], send)
    kg.recompile()
    return kg

