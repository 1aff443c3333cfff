"""Dispatch formation: the FX graph becomes a DispatchPlan of regions.

Groups come from `grouping`; each becomes a Region whose ops are its members plus
the view and CREATE ops they read through (replicated per region, so views become
index maps and small constants are recomputed, never materialised). Values that
cross regions are TensorValues. Graph outputs that are views or inputs get a small
copy region so every returned tensor is a fresh, contiguous value.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from kiln.dispatch.grouping import Group, form_groups
from kiln.errors import UnsupportedOpError
from kiln.ir import treespec
from kiln.ir.graph import KilnGraph, where
from kiln.ir.ops import SHAPE_ONLY_OPS, op_name
from kiln.ir.plan import DispatchPlan, Op, Ref, Region, RegionKind, Role, Sym, TensorValue
from kiln.ir.symbolic import as_dim
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.dispatch")



def _outputs_of(g: Group) -> list[fx.Node]:
    """The nodes whose values leave the group: the root, or the getitems of a tuple root."""
    if isinstance(g.root.meta.get("val"), (tuple, list)):
        return [u for u in g.root.users if op_name(u.target) == "getitem"]
    return [g.root]


def convert_arg(a):
    """An FX argument as a plan argument: tensors become Refs, sizes become Syms."""
    if isinstance(a, fx.Node):
        val = a.meta.get("val")
        if isinstance(val, torch.SymInt):
            d = as_dim(val)
            return d if isinstance(d, int) else Sym(d)
        return Ref(a.name)
    if isinstance(a, (list, tuple)):
        return type(a)(convert_arg(x) for x in a)
    if isinstance(a, torch.SymInt):
        d = as_dim(a)
        return d if isinstance(d, int) else Sym(d)
    return a


def to_op(node: fx.Node) -> Op:
    val = node.meta.get("val")
    is_tensor = isinstance(val, torch.Tensor)
    return Op(
        name=node.name,
        target=op_name(node.target),
        args=tuple(convert_arg(a) for a in node.args),
        kwargs={k: convert_arg(v) for k, v in node.kwargs.items()},
        shape=tuple(as_dim(d) for d in val.shape) if is_tensor else None,
        dtype=val.dtype if is_tensor else None,
        where=where(node),
    )


_USER_KINDS = ("user", "user_const", "user_size")


def _const_args(kg: KilnGraph) -> dict[int, object]:
    """Flat argument index -> value, for the non-tensor arguments export specialised on."""
    user = [s for s in kg.inputs if s.kind in _USER_KINDS]
    return {i: s.value for i, s in enumerate(user) if s.kind == "user_const"}


def _size_args(kg: KilnGraph) -> list[tuple[int, str, str]]:
    """(flat argument index, name, size symbol) of each dynamic int argument."""
    user = [s for s in kg.inputs if s.kind in _USER_KINDS]
    return [(i, s.name, s.value) for i, s in enumerate(user) if s.kind == "user_size"]


class _Lowering:
    def __init__(self, kg: KilnGraph, groups: list[Group]):
        self.kg = kg
        self.groups = groups
        self.order = {n: i for i, n in enumerate(kg.graph.nodes)}
        self.materialized: set[fx.Node] = {n for n in kg.graph.nodes if n.op == "placeholder"}
        for g in groups:
            self.materialized.update(_outputs_of(g))

    def region_ops(self, roots: list[fx.Node], members: set[fx.Node]):
        """The ops a region runs to produce `roots`, and the plan values it reads."""
        needed: set[fx.Node] = set()
        inputs: list[str] = []

        def visit(n: fx.Node, top: bool = False):
            if isinstance(n.meta.get("val"), torch.SymInt):
                return  # a size (an int argument's too): a Sym argument, not a value
            if not top and n in self.materialized and n not in members:
                if n.name not in inputs:
                    inputs.append(n.name)
                return
            if n in needed:
                return
            for a in n.all_input_nodes:
                visit(a)
            needed.add(n)

        for r in roots:
            visit(r, top=True)
        ops = [to_op(n) for n in sorted(needed, key=self.order.__getitem__)]
        return ops, inputs

    def build(self) -> DispatchPlan:
        kg = self.kg
        values: dict[str, TensorValue] = {}
        placeholders = kg.placeholders()
        for spec in kg.inputs:
            if spec.kind in ("user_const", "user_size"):
                continue
            val = placeholders[spec.name].meta["val"]
            roles = {"user": Role.INPUT, "recv": Role.INPUT, "param": Role.WEIGHT,
                     "constant": Role.WEIGHT}
            role = roles.get(spec.kind)
            if spec.kind == "buffer":
                role = Role.STATE if spec.target in kg.mutable else Role.WEIGHT
            target = None if spec.kind == "recv" else spec.target  # a recv is no state
            values[spec.name] = TensorValue(
                spec.name, tuple(as_dim(d) for d in val.shape), val.dtype, role, target
            )
        regions: list[Region] = []
        for g in self.groups:
            outs = _outputs_of(g)
            members = set(g.members) | set(outs)
            ops, inputs = self.region_ops(outs, members)
            label = (g.anchor or g.root).meta.get("kiln.pattern")
            regions.append(Region(f"r{len(regions)}", g.kind, ops, inputs, [o.name for o in outs],
                                  label=label))
            for o in outs:
                values[o.name] = TensorValue(
                    o.name, tuple(as_dim(d) for d in o.meta["val"].shape), o.meta["val"].dtype,
                    Role.TEMP,
                )
        plan = DispatchPlan(
            symbols=dict(kg.symbols),
            dim_names=dict(kg.dim_names),
            values=values,
            regions=regions,
            user_inputs=[i.name for i in kg.inputs if i.kind == "user"],
            const_args=_const_args(kg),
            size_args=_size_args(kg),
            size_checks=[(as_dim(d), r, t) for d, r, t in kg.size_checks],
            outputs=[],
            in_spec=treespec.dumps(kg.in_spec),
            out_spec=treespec.dumps(kg.out_spec),
            none_outputs=list(kg.none_outputs),
        )
        plan.recv = [(i.name, i.stage) for i in kg.inputs if i.kind == "recv"]
        self._outputs(plan)
        return plan

    def _outputs(self, plan: DispatchPlan) -> None:
        returned: dict[fx.Node, str] = {}
        for spec, node in zip(self.kg.outputs, self.kg.output_values()):
            if not isinstance(node, fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
                raise UnsupportedOpError(
                    f"the model returns a {type(node).__name__}; kiln returns tensors only",
                    hint="return tensors (or tuples/dicts of tensors) from forward",
                )
            name = node.name
            if node in returned:  # the same tensor returned twice: one value, as in eager
                name = returned[node]
            elif name not in plan.values or plan.values[name].role != Role.TEMP:
                name = self._absorb_reshape(plan, node) or self._copy_region(plan, node)
            returned[node] = name
            if spec.kind == "user":
                plan.values[name].role = Role.OUTPUT
                plan.outputs.append(name)
            elif spec.kind == "send":  # fresh each call, like a user output
                plan.values[name].role = Role.OUTPUT
                plan.send.append((name, tuple(spec.stages)))
            else:
                plan.state_writes[spec.target] = name

    def _absorb_reshape(self, plan: DispatchPlan, node: fx.Node) -> str | None:
        """A returned reshape of a region's only output becomes that region's output.

        Row-major data is the same bytes in either shape, so the region simply writes
        the reshaped value; no copy region is needed.
        """
        chain = []
        src = node
        while isinstance(src, fx.Node) and op_name(src.target) in SHAPE_ONLY_OPS:
            chain.append(src)
            src = src.args[0]
        if not chain or src.name not in plan.values:
            return None
        # every other reader of the value (another returned view, or the value itself
        # returned too) still needs it in its own shape
        links = set(chain)
        if any(u not in links for n in [src, *chain[1:]] for u in n.users):
            return None
        producer = plan.producers().get(src.name)
        readers = [r for r in plan.regions if src.name in r.inputs]
        if (producer is None or producer.outputs != [src.name] or readers
                or src.name in plan.state_writes.values() or producer.inplace):
            return None
        producer.ops += [to_op(n) for n in reversed(chain)]
        producer.outputs = [node.name]
        val = node.meta["val"]
        del plan.values[src.name]
        plan.values[node.name] = TensorValue(node.name, tuple(as_dim(d) for d in val.shape),
                                             val.dtype, Role.TEMP)
        return node.name

    def _copy_region(self, plan: DispatchPlan, node: fx.Node) -> str:
        """Materialise a returned view / input / constant as a fresh value."""
        if node.op == "placeholder":
            name = f"{node.name}_copy"
            val = node.meta["val"]
            ops = [Op(name, "aten.clone.default", (Ref(node.name),), {},
                      tuple(as_dim(d) for d in val.shape), val.dtype)]
            inputs = [node.name]
        else:
            name = node.name
            ops, inputs = self.region_ops([node], set())
        plan.regions.append(Region(f"r{len(plan.regions)}", RegionKind.COPY, ops, inputs, [name]))
        val = node.meta["val"]
        plan.values[name] = TensorValue(name, tuple(as_dim(d) for d in val.shape), val.dtype,
                                        Role.TEMP)
        return name


@as_pass
def form_regions(kg: KilnGraph, ctx) -> DispatchPlan:
    groups = form_groups(kg.graph, kg.symbols)
    plan = _Lowering(kg, groups).build()
    counts: dict[str, int] = {}
    for r in plan.regions:
        counts[r.kind.value] = counts.get(r.kind.value, 0) + 1
    log.info("formed %d regions: %s", len(plan.regions), counts)
    return plan

