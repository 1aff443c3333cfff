"""Loads issued early in generated straight-line code.

A GPU warp issues its instructions in order, and a load's latency (a DRAM round trip,
~1 us) is hidden only by what is issued after it and before its value is used. Lines a
template emits load where the emitter first needs a value: a decode attention kernel's
prologue loaded q, ran the rotary arithmetic on it, and only then loaded the key bounds
and the query position, each batch waiting for the one before (ncu, H200: 22% of the
kernel's warp samples in the prologue). Moving every load up to just after the last line
that defines a name it reads puts the round trips side by side; a loop-invariant load
inside a key loop (the query position a causal mask compares with) is read once, before
the loop, instead of on every step's critical path.

Lines are Triton source, one statement each. Only top-level assignments `name = expr`
move or are moved across; anything else (a block, a store, a barrier) stays where it is
and no load crosses it.
"""

from __future__ import annotations

import re

_ASSIGN = re.compile(r"^([A-Za-z_]\w*) = (.+)$")
_NAME = re.compile(r"(?<![.\w])[A-Za-z_]\w*")
_STRING = re.compile(r"\"[^\"]*\"|'[^']*'")


def _assignment(line: str) -> tuple[str, set[str]] | None:
    """(the name `line` assigns, the names its value reads), or None if it is not a
    top-level assignment."""
    m = _ASSIGN.match(line)
    if m is None:
        return None
    return m.group(1), set(_NAME.findall(_STRING.sub("", m.group(2))))


def _is_load(line: str) -> bool:
    m = _ASSIGN.match(line)
    return m is not None and m.group(2).startswith("tl.load(")


def loads_first(lines: list[str]) -> list[str]:
    """`lines` with each load moved up to just after the last line it depends on: one
    that defines a name it reads, reads or defines the name it assigns, or is not a
    top-level assignment; loads keep their order among themselves, as do the other
    lines."""
    out: list[str] = []
    for line in lines:
        if not _is_load(line):
            out.append(line)
            continue
        name, reads = _assignment(line)
        at = len(out)
        while at > 0:
            prev = _assignment(out[at - 1])
            if (prev is None or _is_load(out[at - 1]) or prev[0] in reads
                    or prev[0] == name or name in prev[1]):
                break
            at -= 1
        out.insert(at, line)
    return out


def invariant_loads(body: list[str], loop_vars: set[str]) -> tuple[list[str], list[str]]:
    """(the loads of loop body `body` that read no name the loop defines, the body
    without them). `loop_vars`: the loop's own variables (its index). Only a flat body
    (top-level assignments only) gives up its loads."""
    parsed = [_assignment(x) for x in body]
    if any(p is None for p in parsed):
        return [], body
    defined = loop_vars | {p[0] for p in parsed}
    hoisted = [x for x, p in zip(body, parsed)
               if _is_load(x) and not (p[1] & defined) and
               sum(q[0] == p[0] for q in parsed) == 1]
    return hoisted, [x for x in body if x not in hoisted]
