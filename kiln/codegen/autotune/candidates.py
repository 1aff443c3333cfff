"""Which configs a tune mode tries, and the target limits every candidate must meet.

Modes (ctx.options["tune"], the CLI's --tune):
    none  the spec's default (heuristic) config only; compiled in a worker all the same
    fast  the default and its neighbours: configs of the spec that differ from it in
          one knob (a block size, the warps or the stages), as coordinate-descent tuning
          starts; topped up from the spec's list when that leaves too few
    full  every config of the spec, the default first

Whether a candidate fits the target is not decided here: kiln.codegen.build.resources
owns that (before compiling from the estimate, after from the binary's real figures).
"""

from __future__ import annotations

import logging

from kiln.codegen.build.spec import Config, KernelSpec

log = logging.getLogger("kiln.codegen")

MODES = ("none", "fast", "full")
FAST_MIN, FAST_MAX = 3, 8


def candidates(spec: KernelSpec, mode: str) -> list[Config]:
    """The configs to try, best guess first (the default), without duplicates."""
    everything = list(dict.fromkeys([spec.default, *spec.configs]))
    if mode == "none":
        return [spec.default]
    if mode == "full":
        return everything
    near = [c for c in everything[1:] if _knobs_changed(spec.default, c) == 1]
    chosen = [spec.default, *near]
    for c in everything[1:]:
        if len(chosen) >= FAST_MIN:
            break
        if c not in chosen:
            chosen.append(c)
    return chosen[:FAST_MAX]


def _knobs_changed(a: Config, b: Config) -> int:
    pa, pb = a.as_dict(), b.as_dict()
    changed = sum(pa.get(k) != pb.get(k) for k in set(pa) | set(pb))
    return changed + (a.num_warps != b.num_warps) + (a.num_stages != b.num_stages)
