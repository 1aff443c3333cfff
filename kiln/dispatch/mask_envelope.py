"""Per mask row, the keys an attention mask lets through: one region per distinct mask.

An explicit mask over a static KV cache (gpt-fast's `causal[None, None, input_pos]`)
hides most of the keys from most rows: half the blocks at prefill, everything past the
context at decode (128 of 2304 slots). The attention kernel reads the mask block by
block and cannot tell a dead block from a live one before loading it, so it walked them
all. Here every such mask gets its envelope, three int32 values per mask row: `start`,
the first key the row lets through (>= KEY_BOUND_NONE when none), `end`, one past
the last (0 when none), and `plain`, how many keys the mask passes unchanged (bool:
True; float: exactly 0). The attention template bounds its key loop by the envelope of
its tile's rows (its loop bounds become loads, which keeps Triton's pipelining; a
skipping `if` inside the loop lost it) and still applies the mask inside, so any mask
stays exact. Where every row of a tile has `plain` >= end - start (a causal or sliding
window mask: each row's live keys are one run, unbiased) and the rows' runs meet,
the mask says nothing its envelope does not: the tile compares key indices with its
rows' bounds and never loads the mask (an H200, prefill 2048: the mask tiles had taken
kiln's attention from 133 us with `is_causal` to 297 us; without them 161 us). A mask
whose form passes each row a prefix of the keys (prefix_mask.py: kiln.models' and the
transformers recipe's prompt over a cache) is plain in every tile: its envelope has no
count and the kernel no mask loops.

The envelope is a reduction region (ATen ops: the reduction template, or torch ops)
placed before the first attention region reading it, computed once per distinct mask:
a mask value regions share (the same plan value) or the same prologue ops over the same
inputs (a mask each region builds itself) on one device. A float mask lets a key
through where it is not -inf. A mask the template recognises as causal (causal_mask.py)
gets none: its bounds are known without reading anything. Only targets that generate
kernels: the CPU target runs SDPA itself; `options={"mask_envelope": False}` leaves
them out (to measure what they give).
"""

from __future__ import annotations

import copy
import logging

import torch

from kiln.dispatch.causal_mask import is_causal_mask
from kiln.dispatch.prefix_mask import is_prefix_mask
from kiln.ir.ops import SDPA_FORMS, bind_args
from kiln.ir.plan import DispatchPlan, Op, Ref, Region, RegionKind, Role, Sym, TensorValue
from kiln.ir.symbolic import bounds_of, same_dim
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.dispatch")

# A dead key's candidate for the row's first key: past any key a mask can have.
KEY_BOUND_NONE = 1 << 30
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _shape(region: Region, plan: DispatchPlan, name: str):
    return tuple(plan.values[name].shape if name in region.inputs else region.op(name).shape)


def _dtype(region: Region, plan: DispatchPlan, name: str) -> torch.dtype:
    return plan.values[name].dtype if name in region.inputs else region.op(name).dtype


def bounded_mask(region: Region, plan: DispatchPlan) -> str | None:
    """The attention region's mask (an input or op name) when an envelope can bound its
    key loop: an explicit bool or float mask over every key (not broadcast over them),
    not recognised as causal, no dropout. None otherwise."""
    if region.kind != RegionKind.ATTENTION:
        return None
    anchor = region.anchor()
    if anchor.target not in SDPA_FORMS:
        return None
    a = bind_args(anchor)
    mask, key = a.get("attn_mask"), a.get("key")
    if not (isinstance(mask, Ref) and isinstance(key, Ref)) or a.get("dropout_p", 0.0):
        return None
    if a.get("is_causal") or _dtype(region, plan, mask.name) not in (torch.bool, *_FLOATS):
        return None
    shape, keys = _shape(region, plan, mask.name), _shape(region, plan, key.name)
    if len(shape) < 2 or len(keys) < 2 or not same_dim(shape[-1], keys[-2]):
        return None
    hi = bounds_of(shape[-1], plan.symbols).hi
    if same_dim(shape[-1], 1) or hi is None or hi >= KEY_BOUND_NONE:
        return None
    return None if is_causal_mask(region, mask.name) else mask.name


def _closure(region: Region, name: str) -> list[Op]:
    """The region's ops `name` depends on, in order (nothing if it is an input)."""
    ops = {o.name: o for o in region.ops}
    need, stack = set(), [name]
    while stack:
        n = stack.pop()
        if n in ops and n not in need:
            need.add(n)
            stack += ops[n].refs()
    return [o for o in region.ops if o.name in need]


def _key(region: Region, mask: str, ops: list[Op]) -> tuple:
    """Equal for masks that are the same value: one plan value, or the same ops over
    the same inputs (region-local op names aside)."""
    if not ops:
        return (region.device, "value", mask)
    pos = {o.name: i for i, o in enumerate(ops)}

    def canon(x):
        if isinstance(x, Ref):
            return ("op", pos[x.name]) if x.name in pos else ("in", x.name)
        if isinstance(x, (list, tuple)):
            return tuple(canon(y) for y in x)
        return repr(x)

    return (region.device, "ops", tuple((o.target, canon(o.args),
                                         tuple(sorted((k, canon(v)) for k, v in o.kwargs.items())),
                                         repr(o.shape), repr(o.dtype)) for o in ops))


class _Names:
    """Fresh value and op names, unique in the plan."""

    def __init__(self, plan: DispatchPlan):
        self.used = set(plan.values) | {o.name for r in plan.regions for o in r.ops}

    def __call__(self, base: str) -> str:
        name, i = base, 1
        while name in self.used:
            i += 1
            name = f"{base}_{i}"
        self.used.add(name)
        return name


def _envelope_ops(mask: str, shape: tuple, dtype: torch.dtype, fresh: _Names,
                  start: str, end: str, plain: str | None) -> list[Op]:
    """start = min_j (j if live else j + KEY_BOUND_NONE), end = max_j (j + 1 if live else
    0), plain = sum_j (passed unchanged) over the mask's last dim (none where the mask's
    form makes every tile plain), in int32 arithmetic the reduction template emits."""
    i32, keys = torch.int32, shape[-1]
    n = {k: fresh(f"{mask}_{k}") for k in ("ne", "live", "j", "shift", "jshift", "first",
                                           "j1", "last", "eq", "unbiased")}
    ops = []
    live_of, plain_of = Ref(mask), Ref(n["live"])
    if dtype != torch.bool:
        ops += [Op(n["ne"], "aten.ne.Scalar", (Ref(mask), float("-inf")), {}, shape,
                   torch.bool),
                Op(n["eq"], "aten.eq.Scalar", (Ref(mask), 0.0), {}, shape, torch.bool),
                Op(n["unbiased"], "aten._to_copy.default", (Ref(n["eq"]),), {"dtype": i32},
                   shape, i32)]
        live_of, plain_of = Ref(n["ne"]), Ref(n["unbiased"])
    size = keys if isinstance(keys, int) else Sym(keys)
    ops += [
        Op(n["live"], "aten._to_copy.default", (live_of,), {"dtype": i32}, shape, i32),
        Op(n["j"], "aten.arange.start_step", (0, size),
           {"dtype": i32, "device": torch.device("cpu")}, (keys,), i32),
        Op(n["shift"], "aten.mul.Tensor", (Ref(n["live"]), -KEY_BOUND_NONE), {}, shape, i32),
        Op(n["jshift"], "aten.add.Tensor", (Ref(n["j"]), Ref(n["shift"])), {}, shape, i32),
        Op(n["first"], "aten.add.Tensor", (Ref(n["jshift"]), KEY_BOUND_NONE), {}, shape, i32),
        Op(start, "aten.amin.default", (Ref(n["first"]), [-1]), {}, shape[:-1], i32),
        Op(n["j1"], "aten.add.Tensor", (Ref(n["j"]), 1), {}, (keys,), i32),
        Op(n["last"], "aten.mul.Tensor", (Ref(n["j1"]), Ref(n["live"])), {}, shape, i32),
        Op(end, "aten.amax.default", (Ref(n["last"]), [-1]), {}, shape[:-1], i32),
    ]
    if plain is not None:
        ops.append(Op(plain, "aten.sum.dim_IntList", (plain_of, [-1]), {"dtype": i32},
                      shape[:-1], i32))
    return ops


def add_envelopes(plan: DispatchPlan) -> int:
    """Give every attention region with a boundable mask its envelope (region.key_bounds);
    returns how many envelope regions were made."""
    made: dict[tuple, tuple[str, str, str]] = {}
    fresh = _Names(plan)
    for region in list(plan.regions):
        mask = bounded_mask(region, plan)
        if mask is None:
            continue
        ops = _closure(region, mask)
        key = _key(region, mask, ops)
        if key not in made:
            shape, dtype = _shape(region, plan, mask), _dtype(region, plan, mask)
            prefix = is_prefix_mask(plan, region, mask)
            bounds = tuple(fresh(f"{mask}_key_{k}") for k in ("start", "end", "plain")
                           [:2 if prefix else 3]) + ((None,) if prefix else ())
            moved = [copy.deepcopy(o) for o in ops]
            body = moved + _envelope_ops(mask, shape, dtype, fresh, *bounds)
            used = {r for o in body for r in o.refs()}
            inputs = [v for v in region.inputs if v in used]
            made_values = [v for v in bounds if v is not None]
            env = Region(fresh(f"{region.name}_key_bounds"), RegionKind.REDUCTION, body,
                         inputs, made_values, device=region.device)
            for v in made_values:
                plan.values[v] = TensorValue(v, tuple(shape[:-1]), torch.int32, Role.TEMP)
            env.notes.append(f"the key bounds of attention mask %{mask} per row: its first "
                             "live key, one past its last" + (
                                 " (a prefix of the keys a row by the mask's form: every "
                                 "tile plain)" if prefix else " and how many keys it passes "
                                 "unchanged") + ", for the attention regions reading it")
            plan.regions.insert(plan.regions.index(region), env)
            made[key] = bounds
            log.info("key bounds of mask %%%s: region %s", mask, env.name)
        region.key_bounds = made[key]
        region.inputs = list(dict.fromkeys(region.inputs + region.key_bound_values()))
        region.notes.append(f"key loop bounded per row block by %{made[key][0]}, "
                            f"%{made[key][1]}: the keys mask %{mask} lets through")
    return len(made)


@as_pass
def mask_envelope(plan: DispatchPlan, ctx) -> DispatchPlan:
    if ctx.target.uses_triton and ctx.options.get("mask_envelope", True):
        add_envelopes(plan)
    return plan
