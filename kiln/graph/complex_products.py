"""Complex products in real arithmetic: RoPE written as a complex multiply.

Meta's reference Llama (and torchtitan's) rotates q and k as complex numbers,
`view_as_real(view_as_complex(x.reshape(..., D/2, 2)) * freqs_cis[pos])`, over a
complex64 table. Triton has no complex dtypes, so each complex op ran as PyTorch's own
(extern), and so did every region taking one as a prologue: a decode layer's attention
and KV-cache writes, 9 of its 21 regions. The product is the same arithmetic on
(re, im) pairs,

    view_as_real(a * b) = stack(ar * br - ai * bi, ar * bi + ai * br, dim=-1),

a's pairs being view_as_complex's input and b's the table read through the same ops
(index, unsqueeze, views, slices) on its real form: `view_as_real(table)`, a float
[..., 2] constant made once here from the weight, as fold_constants makes weight-only
compute, and recorded as derived from the table (ir/derived.py): the compile cache
keeps that recipe, not the pairs, and recomputes them from the model's own table at a
hit (another theta is never served stale pairs). A complex value this cannot see back
to one of those (a complex input, a table the model writes, another op) leaves its
product as it was.
"""

from __future__ import annotations

import torch.fx as fx

from kiln.graph.dce import eliminate_dead_code
from kiln.graph.fold_constants import add_constant, constant_placeholders, drop_unread
from kiln.graph.rewrite import aten, insert, name_of, rank
from kiln.ir.derived import Derivation
from kiln.ir.graph import KilnGraph
from kiln.ir.ops import norm_axis
from kiln.pipeline import as_pass

# ops on a complex value whose real form is the same op on [..., 2] pairs, dims unchanged
_SAME_DIMS = {"aten.unsqueeze.default", "aten.slice.Tensor", "aten.select.int"}


class _Pairs:
    """The real [..., 2] form of complex values, built at most once each."""

    def __init__(self, kg: KilnGraph):
        self.kg = kg
        self.weights = constant_placeholders(kg)
        self.targets = {i.name: i.target for i in kg.inputs}
        self.made: dict[fx.Node, fx.Node | None] = {}

    def of(self, x, at: fx.Node) -> fx.Node | None:
        if not isinstance(x, fx.Node) or not x.meta["val"].is_complex():
            return None
        if x not in self.made:
            self.made[x] = self._make(x, at)
        return self.made[x]

    def _table_pairs(self, x: fx.Node) -> fx.Node:
        """The table's pairs as a constant, recorded as derived from the table (so the
        compile cache replays the recipe on the model's table at a hit)."""
        derivation = Derivation(self.targets[x.name], ("view_as_real",))
        return add_constant(self.kg, x, derivation.apply(self.weights[x]), derivation)

    def _make(self, x: fx.Node, at: fx.Node) -> fx.Node | None:
        name = name_of(x)
        if name == "aten.view_as_complex.default":
            return x.args[0]
        if x in self.weights:  # a table the model never writes: its pairs, as a constant
            return self._table_pairs(x)
        if name == "aten.polar.default":  # abs * (cos, sin) of angle: a table built in forward
            r, theta = x.args
            parts = [insert(self.kg, at, aten.mul.Tensor,
                            (r, insert(self.kg, at, f, (theta,), like=x)), like=x)
                     for f in (aten.cos.default, aten.sin.default)]
            return _stack(self.kg, at, parts, x)
        if len(x.args) < 2 or x.kwargs:  # the ops below, spelled with their dims
            return None
        src = x.args[0]
        pairs = self.of(src, at)
        if pairs is None:
            return None
        if name == "aten.index.Tensor" and len(x.args[1]) <= rank(src):
            return insert(self.kg, at, aten.index.Tensor, (pairs, x.args[1]), like=x)
        if name in _SAME_DIMS:
            dim = norm_axis(x.args[1], rank(x) if name.startswith("aten.unsqueeze") else rank(src))
            return insert(self.kg, at, x.target, (pairs, dim, *x.args[2:]), like=x)
        if name in ("aten.view.default", "aten.expand.default"):
            return insert(self.kg, at, x.target, (pairs, [*x.args[1], 2]), like=x)
        if name == "aten.permute.default":
            dims = [norm_axis(d, rank(src)) for d in x.args[1]]
            return insert(self.kg, at, x.target, (pairs, [*dims, rank(src)]), like=x)
        return None


def _product(kg: KilnGraph, at: fx.Node, a: fx.Node, b: fx.Node) -> fx.Node:
    """stack(ar * br - ai * bi, ar * bi + ai * br, dim=-1) of pairs a and b, before `at`."""
    def part(p, i):
        return insert(kg, at, aten.select.int, (p, rank(p) - 1, i), like=at)

    def op(target, x, y):
        return insert(kg, at, target, (x, y), like=at)

    ar, ai, br, bi = part(a, 0), part(a, 1), part(b, 0), part(b, 1)
    re = op(aten.sub.Tensor, op(aten.mul.Tensor, ar, br), op(aten.mul.Tensor, ai, bi))
    im = op(aten.add.Tensor, op(aten.mul.Tensor, ar, bi), op(aten.mul.Tensor, ai, br))
    return _stack(kg, at, [re, im], at)


def _stack(kg: KilnGraph, at: fx.Node, parts: list[fx.Node], like: fx.Node) -> fx.Node:
    """(re, im) as pairs: stack(parts, dim=-1), spelled as core ATen does."""
    parts = [insert(kg, at, aten.unsqueeze.default, (v, rank(v)), like=like) for v in parts]
    return insert(kg, at, aten.cat.default, (parts, rank(parts[0]) - 1), like=like)


def real_products(kg: KilnGraph) -> int:
    """Rewrite each view_as_real(a * b) of complex a, b in real arithmetic; how many."""
    pairs, done = _Pairs(kg), 0
    for node in list(kg.graph.nodes):
        prod = node.args[0] if name_of(node) == "aten.view_as_real.default" else None
        if name_of(prod) != "aten.mul.Tensor" or len(prod.args) != 2:
            continue
        a, b = (pairs.of(x, node) for x in prod.args)
        if a is None or b is None or a.meta["val"].dtype != node.meta["val"].dtype \
                or b.meta["val"].dtype != node.meta["val"].dtype:
            continue
        node.replace_all_uses_with(_product(kg, node, a, b))
        done += 1
    if done:
        eliminate_dead_code(kg)
        drop_unread(kg, pairs.weights)  # a complex table now read only as its pairs
    return done


@as_pass
def complex_products(kg: KilnGraph, ctx) -> KilnGraph:
    if real_products(kg):
        kg.recompile()
    return kg
