"""A GraphSpec (spec.py) as Python source, as the module built from it, and as values.

The same spec renders as the module kiln compiles, as the float64 reference (every
float dtype spelled float64), and as a standalone repro file; the minimiser edits the
spec (cut a node, drop an output, make the dynamic dim static) and renders again.
Shapes and dtypes are never written down by hand: `infer_meta` runs the spec eagerly
at two sizes of the dynamic dim and reads them off, so an op whose output size
depends on the dim in any way but "equals it" is caught there.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.fuzz.ops import RENDER
from tests.fuzz.spec import (  # noqa: F401 - the spec's names, re-exported for callers
    DTYPES,
    DYN,
    FLOATS,
    GraphSpec,
    Node,
    Spelling,
    TensorSpec,
    dtype_key,
)


def render_node(node: Node, sp: Spelling) -> list[str]:
    text = RENDER[node.op](node.ins, node.p, sp)
    lines = text if isinstance(text, list) else [text]
    return lines[:-1] + [f"{node.out} = {lines[-1]}"]


def live_nodes(spec: GraphSpec) -> list[Node]:
    """The nodes the outputs depend on, plus every buffer write (a side effect)."""
    need = set(spec.outputs)
    keep = []
    for n in reversed(spec.nodes):
        if n.out in need or n.op.startswith("buf_"):
            keep.append(n)
            need.update(n.ins)
    return list(reversed(keep))


def module_source(spec: GraphSpec, sp: Spelling, cls: str = "Fuzzed") -> str:
    used = {v for n in spec.nodes for v in n.ins} | set(spec.outputs)
    args = [t.name for t in spec.inputs]
    lines = [f"class {cls}(nn.Module):", "    def __init__(self):", "        super().__init__()",
             f"        g = torch.Generator().manual_seed({spec.seed})"]
    for t in spec.params:
        lines.append(f"        self.{t.name} = nn.Parameter({_init_expr(t, sp)}, "
                     f"requires_grad=False)")
    for t in spec.buffers:
        lines.append(f"        self.register_buffer({t.name!r}, {_init_expr(t, sp)})")
    lines.append(f"    def forward(self, {', '.join(args)}):")
    for t in spec.params + spec.buffers:
        if t.name in used:
            lines.append(f"        {t.name} = self.{t.name}")
    for n in spec.nodes:
        lines += ["        " + s for s in render_node(n, sp)]
    outs = ", ".join(spec.outputs)
    lines.append(f"        return ({outs},)" if outs else "        return ()")
    return "\n".join(lines) + "\n"


def _init_expr(t: TensorSpec, sp: Spelling) -> str:
    shape = tuple(t.shape)
    if t.dtype in FLOATS:
        return f"torch.randn({shape}, generator=g).to({sp.dt(t.dtype)})"
    if t.dtype == "bool":
        return f"torch.rand({shape}, generator=g) < 0.5"
    return f"torch.randint(0, {max(t.high, 1)}, {shape}, generator=g)"


PRELUDE = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"


def build_module(spec: GraphSpec, f64: bool = False) -> nn.Module:
    src = module_source(spec, Spelling(f64))
    scope = {"torch": torch, "nn": nn, "F": F}
    exec(compile(src, f"<fuzz graph {spec.seed}>", "exec"), scope)  # noqa: S102
    return scope["Fuzzed"]().eval()


def concrete_shape(shape, size: int | None) -> tuple[int, ...]:
    return tuple(size if d == DYN else d for d in shape)


def make_args(spec: GraphSpec, size: int | None, call: int) -> tuple[torch.Tensor, ...]:
    """The inputs of call number `call` at dynamic size `size`: seeded, fresh per call."""
    g = torch.Generator().manual_seed(spec.seed * 1009 + call * 7919 + (size or 0))
    out = []
    for t in spec.inputs:
        shape = concrete_shape(t.shape, size)
        if t.dtype in FLOATS:
            out.append(torch.randn(shape, generator=g).to(DTYPES[t.dtype]))
        elif t.dtype == "bool":
            out.append(torch.rand(shape, generator=g) < 0.5)
        else:
            out.append(torch.randint(0, max(t.high, 1), shape, generator=g))
    return tuple(out)


def dynamic_shapes(spec: GraphSpec):
    """The dynamic_shapes argument of kiln.compile: one shared Dim for every DYN entry."""
    if spec.dyn is None:
        return None
    from kiln import Dim

    d = Dim("D", min=spec.dyn[0], max=spec.dyn[1])
    return tuple({i: d for i, e in enumerate(t.shape) if e == DYN} or None
                 for t in spec.inputs)


def run_eager(spec: GraphSpec, module: nn.Module, args) -> tuple:
    with torch.no_grad():
        return module(*args)


def infer_meta(spec: GraphSpec) -> dict[str, tuple[tuple, torch.dtype]]:
    """Every value's (shape template, dtype), from running the spec at two sizes.

    Raises if the spec fails eagerly or a size follows the dynamic dim other than by
    equalling it (the generator then drops the op, the minimiser the candidate)."""
    tracer = Tracer(spec)
    for n in spec.nodes:
        tracer.run(n)
    return tracer.meta


class Tracer:
    """Runs a spec node by node at two sizes of the dynamic dim, keeping every value."""

    def __init__(self, spec: GraphSpec):
        self.spec = spec
        if spec.dyn:
            lo, hi, ex = spec.dyn[0], spec.dyn[1], spec.dyn[2]
            self.sizes = [ex, ex + 1 if ex + 1 <= hi else ex - 1]
            if self.sizes[1] < lo:
                self.sizes = [ex]
        else:
            self.sizes = [None]
        self.gen = torch.Generator().manual_seed(spec.seed)
        self.scopes = [{"torch": torch, "F": F, "self": _Holder()} for _ in self.sizes]
        self.meta: dict[str, tuple[tuple, torch.dtype]] = {}
        self.sync_leaves()

    def sync_leaves(self) -> None:
        """Give every leaf the generator has added since the last call a random value."""
        for kind, leaves in (("in", self.spec.inputs), ("p", self.spec.params),
                             ("b", self.spec.buffers)):
            for t in leaves:
                if t.name in self.meta:
                    continue
                for size, scope in zip(self.sizes, self.scopes):
                    val = _random_value(t, size, self.gen)
                    scope[t.name] = val
                    if kind != "in":
                        setattr(scope["self"], t.name, val)
                self.meta[t.name] = (tuple(t.shape), DTYPES[t.dtype])

    def run(self, node: Node) -> tuple[tuple, torch.dtype]:
        self.sync_leaves()
        src = "\n".join(render_node(node, Spelling()))
        vals = []
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for scope in self.scopes:
                exec(src, scope)  # noqa: S102
                vals.append(scope[node.out])
        if not all(isinstance(v, torch.Tensor) for v in vals):
            raise ValueError(f"{node.out} is not a tensor")
        self.meta[node.out] = m = (self._template(node.out, vals), vals[0].dtype)
        return m

    def forget(self, names) -> None:
        for name in names:
            self.meta.pop(name, None)
            for scope in self.scopes:
                scope.pop(name, None)

    def _template(self, name: str, vals: list[torch.Tensor]) -> tuple:
        if len(vals) == 1:
            return tuple(vals[0].shape)
        a, b = vals
        if a.dim() != b.dim():
            raise ValueError(f"{name}: rank follows the dynamic dim")
        shape = []
        for i, d in enumerate(a.shape):
            if b.shape[i] == d:
                shape.append(d)
            elif d == self.sizes[0] and b.shape[i] == self.sizes[1]:
                shape.append(DYN)
            else:
                raise ValueError(f"{name}: dim {i} is a function of the dynamic dim")
        return tuple(shape)


class _Holder:
    """Stands in for the module (`self.b0`) while tracing."""


def _random_value(t: TensorSpec, size: int | None, g: torch.Generator) -> torch.Tensor:
    shape = concrete_shape(t.shape, size)
    if t.dtype in FLOATS:
        return torch.randn(shape, generator=g).to(DTYPES[t.dtype])
    if t.dtype == "bool":
        return torch.rand(shape, generator=g) < 0.5
    return torch.randint(0, max(t.high, 1), shape, generator=g)
