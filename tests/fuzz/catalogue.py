"""The op catalogue's registry: how each op renders (RENDER), how one is drawn (GEN), and
how often (WEIGHT). The ops themselves live in ops_math.py and ops_shaped.py.

A generator picks operands among the graph's values (or asks for a new input /
parameter of a shape it needs) and returns a Node, or None when nothing fits. It
does not check validity: the driver runs the graph eagerly at two sizes after
every op and drops the op if that fails (graph.infer_meta), so a generator may be
optimistic. To grow the catalogue with kiln's, add a renderer and a generator (and
watch the run summary's coverage line).
"""

from __future__ import annotations

from tests.fuzz.spec import DYN

RENDER: dict = {}
GEN: dict = {}
WEIGHT: dict = {}


def op(name: str, render, weight: float = 1.0):
    """Register an op: `render` is a format string over {0}, {1}, ... and p, or a function."""
    if isinstance(render, str):
        def fmt(ins, p, sp, _t=render):
            return _t.format(*ins, **p)
        RENDER[name] = fmt
    else:
        RENDER[name] = render
    WEIGHT[name] = weight

    def deco(gen):
        GEN[name] = gen
        return gen
    return deco


def is_float(m) -> bool:
    return str(m[1]).split(".")[1] in ("float32", "float16", "bfloat16")


def static_axes(shape) -> list[int]:
    return [i for i, d in enumerate(shape) if d != DYN]
