"""Random arguments that match a compiled module's signature (for `kiln run ARTIFACT`
and `kiln run MODEL --size`).

Sizes of dynamic dims come from the caller (by symbol or torch.export.Dim name), else
the example's, else the lower bound. Float tensors are standard normal, bools fair
coins; integer tensors used as indices (embedding ids, positions, gather/scatter
indices) are drawn below the size of the dim they index, so the run is valid.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from kiln.errors import ShapeError
from kiln.ir import treespec
from kiln.ir.ops import OpCategory, category
from kiln.ir.plan import DispatchPlan, Ref, Region
from kiln.ir.symbolic import evaluate

# Index-taking ops: (argument position of the indexed tensor, of the index, of `dim`).
_INDEX_ARGS = {
    "aten.embedding.default": (0, 1, None),  # weight[idx]: dim 0
    "aten.index_select.default": (0, 2, 1),
    "aten.gather.default": (0, 2, 1),
    "aten.index_copy.default": (0, 2, 1),
    "aten.index_add.default": (0, 2, 1),
    "aten.scatter.src": (0, 2, 1),
    "aten.scatter.value": (0, 2, 1),
    "aten.scatter_add.default": (0, 2, 1),
}
_INDEX_LISTS = {"aten.index.Tensor", "aten.index_put.default"}  # self[i0, i1, ...]


def sizes_for(module, overrides: dict[str, int]) -> dict[str, int]:
    """Each size symbol's value: the override (by symbol or Dim name), example, or lower bound."""
    plan = module.plan
    named = plan.dim_names  # symbol -> Dim name
    names = {n: s for s, n in named.items()}
    example = dict(module.example_sizes)
    env = {s: example.get(s, b.lo) for s, b in plan.symbols.items()}
    for key, value in overrides.items():
        sym = names.get(key, key)
        if sym not in plan.symbols:
            known = [f"{named[s]} ({s})" if s in named else s for s in sorted(plan.symbols)]
            raise ShapeError(
                f"--size {key}={value}: the module has no dynamic dim named {key!r}",
                hint="its dynamic dims are: " + (", ".join(known) if known else "none"),
            )
        b = plan.symbols[sym]
        if not b.contains(value):
            raise ShapeError(f"--size {key}={value} is outside the bounds of {key}: {b}",
                             hint=f"choose a size in {b}")
        env[sym] = value
    return env


def random_inputs(module, env: dict[str, int], seed: int = 0) -> tuple[tuple, dict]:
    """(args, kwargs) for `module` at sizes `env`, drawn reproducibly from `seed`."""
    plan: DispatchPlan = module.plan
    gen = torch.Generator().manual_seed(seed)
    limits = index_limits(plan, env)
    device = module.program.device if _present(module.program.device) else "cpu"
    tensors = []
    for name in plan.user_inputs:
        v = plan.values[name]
        shape = [evaluate(d, env) for d in v.shape]
        if v.dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        elif v.dtype.is_floating_point or v.dtype.is_complex:
            t = torch.randn(shape, generator=gen).to(v.dtype)
        else:
            t = torch.randint(0, limits.get(name, 16), shape, generator=gen).to(v.dtype)
        tensors.append(t.to(device))
    sized = {i: env[sym] for i, _, sym in plan.size_args}  # an int size: its symbol's value
    fixed = {**plan.const_args, **sized}
    n = len(tensors) + len(fixed)
    it = iter(tensors)
    leaves = [fixed[i] if i in fixed else next(it) for i in range(n)]
    args, kwargs = pytree.tree_unflatten(leaves, treespec.loads(plan.in_spec))
    return tuple(args), dict(kwargs)


def _present(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.is_available()


def index_limits(plan: DispatchPlan, env: dict[str, int]) -> dict[str, int]:
    """For user inputs used as indices: one more than the largest valid index."""
    limits: dict[str, int] = {}
    for r in plan.regions:
        shapes = {n: plan.values[n].shape for n in r.inputs}
        shapes.update({o.name: o.shape for o in r.ops if o.shape is not None})
        for op in r.ops:
            if category(op.target) not in (OpCategory.GATHER, OpCategory.SCATTER):
                continue
            for index_ref, size in _indexed(op, shapes, env):
                src = _source(r, index_ref)
                if src in plan.user_inputs:
                    limits[src] = min(limits.get(src, size), size)
    return limits


def _indexed(op, shapes, env):
    """(index Ref, size of the dim it indexes) pairs of one index-taking op."""
    def size(ref, dim):
        shape = shapes.get(ref.name) if isinstance(ref, Ref) else None
        return None if shape is None else evaluate(shape[dim], env)

    if op.target in _INDEX_ARGS:
        table, index, dim = _INDEX_ARGS[op.target]
        if len(op.args) > index and isinstance(op.args[index], Ref):
            n = size(op.args[table], op.args[dim] if dim is not None else 0)
            if n is not None:
                yield op.args[index], n
    elif op.target in _INDEX_LISTS:
        for d, idx in enumerate(op.args[1]):
            if isinstance(idx, Ref):
                n = size(op.args[0], d)
                if n is not None:
                    yield idx, n


def _source(region: Region, ref: Ref) -> str:
    """Follow view ops back to the value a Ref reads (an index seen through a reshape)."""
    name = ref.name
    ops = {o.name: o for o in region.ops}
    while name in ops and category(ops[name].target) == OpCategory.VIEW \
            and isinstance(ops[name].args[0], Ref):
        name = ops[name].args[0].name
    return name
