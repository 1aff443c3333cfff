"""Which configs a tune mode tries, and the target limits every candidate must meet.

Modes (ctx.options["tune"], the CLI's --tune):
    none  the spec's default (heuristic) config only; compiled in a worker all the same
    fast  the default and its neighbours: configs of the spec that differ from it in
          one knob (a block size, the warps or the stages), as coordinate-descent tuning
          starts; topped up from the spec's list when that leaves too few
    full  every config of the spec, the default first

Limits are checked twice, because a config over the target's limits must never be
launched (DESIGN.md failure 1): before compiling from the config itself (threads) and
from kiln.codegen.triton.resources.estimate when that estimator exists, so a config
that cannot fit costs no compile; and after compiling from the binary's real figures.
"""

from __future__ import annotations

import logging

from kiln.codegen.triton.compiler import Resources
from kiln.codegen.triton.spec import Config, KernelSpec
from kiln.target import Target

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


def over_limits(res: Resources, target: Target) -> str | None:
    """Why `res` does not fit `target`, or None when it fits."""
    if res.shared > target.shared_mem_per_block:
        return (f"needs {res.shared} B of shared memory, the target has "
                f"{target.shared_mem_per_block} B")
    if res.threads and res.threads > target.max_threads_per_block:
        return f"needs {res.threads} threads per block, the target allows " \
               f"{target.max_threads_per_block}"
    if res.registers is not None:
        if res.registers > target.registers_per_thread:
            return (f"needs {res.registers} registers per thread, the target has "
                    f"{target.registers_per_thread}")
        if res.threads and res.registers * res.threads > target.registers_per_block:
            return (f"needs {res.registers * res.threads} registers per block, the target "
                    f"has {target.registers_per_block}")
    return None


def default_estimator():
    """kiln.codegen.triton.resources.estimate(spec, config, target), if that module exists."""
    try:
        from kiln.codegen.triton.resources import estimate
    except ImportError:
        return None
    return estimate


def precheck(spec: KernelSpec, config: Config, target: Target, estimator=None) -> str | None:
    """Why `config` cannot fit `target`, known before compiling; None when it may fit.

    `estimator(spec, config, target)` returns an object with `shared` (bytes). Only
    shared memory is trusted before compiling: register estimates are rough, and too
    many registers spill rather than fail. An estimator that fails is ignored (the real
    figures after compiling decide then).
    """
    threads = config.num_warps * target.warp_size
    if threads > target.max_threads_per_block:
        return f"{config.num_warps} warps are {threads} threads, the target allows " \
               f"{target.max_threads_per_block}"
    if estimator is None:
        return None
    try:
        shared = int(estimator(spec, config, target).shared)
    except Exception as e:  # an estimate is an optimisation; compiling still decides
        log.debug("no resource estimate for %s [%s]: %s", spec.name, config, e)
        return None
    res = Resources(shared, None, None, threads)
    why = over_limits(res, target)
    return f"estimated: {why}" if why else None
