"""Recognise an attention mask that lets each query row through a prefix of the keys.

kiln.models' prompt mask over a KV cache (`arange(S)[j] <= input_pos[b, i]`) and
transformers' static-cache recipe's (`kv_idx <= cache_position[q_idx]`) pass, per row,
the keys 0..p exactly, unbiased, with p read from an input. Every tile of such a mask is
plain in the attention template's sense (each row's live keys one run, the runs of any
rows meeting at key 0), so the kernel needs none of the loops that apply a mask tile by
tile; compiled in anyway, they cost ~60 registers and spills at 8B widths (sm_90). The
mask's ops are read as in causal_mask.py, across the regions that compute it, with
every value constant along the keys (a size-1 last dim: the positions of the rows, a
per-row flag) an opaque term: the mask is a prefix when it reduces to `kj - e <= 0`
with e free of kj, and-ed with such per-row flags at most. Anything else is not
recognised, so a wrong answer is impossible, only a missed one.
"""

from __future__ import annotations

import sympy
import torch

from kiln.dispatch.causal_mask import KJ, form
from kiln.ir.ops import RESHAPES
from kiln.ir.plan import DispatchPlan, Ref, Region
from kiln.ir.symbolic import same_dim

_ANDS = ("aten.logical_and.default", "aten.bitwise_and.Tensor", "aten.mul.Tensor")
# views that may put a value's varying dim last (an expand or alias only broadcasts)
_MOVES = RESHAPES | {"aten.unsqueeze.default"}


def is_prefix_mask(plan: DispatchPlan, region: Region, name: str) -> bool:
    """Whether the boolean mask `name` (read by `region`) passes each row a prefix of
    the keys."""
    if _dtype(plan, region, name) != torch.bool:
        return False
    producers = {out: r for r in plan.regions for out in r.outputs}
    found = _read(plan, producers, region, Ref(name))
    if not isinstance(found, tuple):
        return False
    diff = sympy.expand(found[1])
    return diff.coeff(KJ, 1) == 1 and KJ not in (diff - KJ).free_symbols


def _read(plan: DispatchPlan, producers: dict[str, Region], region: Region, arg):
    """causal_mask's form, where a value constant along the keys is an opaque term and
    a region input is read in the region computing it."""
    if not isinstance(arg, Ref):
        return form(region, arg, _sub(plan, producers))
    if arg.name in region.inputs:
        shape = plan.values[arg.name].shape if arg.name in plan.values else None
    else:
        shape = region.op(arg.name).shape
    if shape is not None and _key_free(shape):
        return sympy.Symbol(f"row_{arg.name}", integer=True)
    if arg.name in region.inputs:
        source = producers.get(arg.name)
        if source is None or source is region:
            return None
        return _read(plan, producers, source, arg)
    op = region.op(arg.name)
    if op.target in _MOVES:  # a per-row value moved onto the keys varies along them
        inner = _read(plan, producers, region, op.args[0])
        if isinstance(inner, sympy.Expr) and any(s.name.startswith("row_")
                                                 for s in inner.free_symbols):
            return None
    if op.target in _ANDS and len(op.args) == 2 and op.dtype == torch.bool:
        kept = [a for a in op.args if not _is_key_free(plan, region, a)]
        if len(kept) == 1:  # and-ed with a per-row flag: a prefix or nothing
            return _read(plan, producers, region, kept[0])
    return form(region, arg, _sub(plan, producers))


def _sub(plan, producers):
    return lambda r, a: _read(plan, producers, r, a)


def _key_free(shape) -> bool:
    """Constant along the keys once broadcast to the mask: a size-1 last dim (or none)."""
    return len(shape) == 0 or same_dim(shape[-1], 1)


def _is_key_free(plan: DispatchPlan, region: Region, arg) -> bool:
    if isinstance(arg, (bool, int)):
        return True
    if not isinstance(arg, Ref):
        return False
    if arg.name in region.inputs:
        value = plan.values.get(arg.name)
        return value is not None and _key_free(value.shape)
    return _key_free(region.op(arg.name).shape)


def _dtype(plan: DispatchPlan, region: Region, name: str):
    if name in region.inputs:
        value = plan.values.get(name)
        return value.dtype if value is not None else None
    return region.op(name).dtype
