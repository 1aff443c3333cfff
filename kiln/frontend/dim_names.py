"""The user's torch.export.Dim names for the size symbols export invents (s17 -> "seq").

Read at import from the user's dynamic_shapes and the exported placeholders' symbolic
sizes, then carried in the graph and the plan, so guards, reports and the CLI speak
of `dim "seq"` rather than `s17`; a derived Dim's symbol takes its root's name. Best
effort: a spec it cannot follow (unusual nesting) leaves that symbol unnamed.
"""

from __future__ import annotations

import inspect

import sympy
import torch
import torch.utils._pytree as pytree


def dim_names(ep: torch.export.ExportedProgram, model, args: tuple, kwargs: dict,
              dynamic_shapes) -> dict[str, str]:
    """size symbol -> the Dim name the user gave it."""
    if dynamic_shapes is None:
        return {}
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    user = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    leaves = pytree.tree_leaves((args, kwargs))
    # export's user inputs are the flattened (args, kwargs) leaves, in order
    fake_of = {id(leaf): placeholders[name].meta.get("val")
               for leaf, name in zip(leaves, user) if isinstance(leaf, torch.Tensor)}
    names: dict[str, str] = {}
    for value, spec in _pair_inputs(model, args, kwargs, dynamic_shapes):
        _walk(value, spec, fake_of, names)
    return names


def _pair_inputs(model, args, kwargs, dynamic_shapes):
    if isinstance(dynamic_shapes, dict):
        try:
            bound = inspect.signature(model.forward).bind(*args, **kwargs)
        except (TypeError, ValueError):
            return []
        params = bound.signature.parameters
        pairs = []
        for k, v in bound.arguments.items():
            if params[k].kind != inspect.Parameter.VAR_KEYWORD:
                pairs.append((v, dynamic_shapes.get(k)))
                continue
            # **kwargs: by name at the top level, or torch's way under the **kwargs name
            # (frontend/named_kwargs.py)
            inner = dynamic_shapes.get(k)
            specs = inner if isinstance(inner, dict) else dynamic_shapes
            pairs += [(vv, specs.get(kk)) for kk, vv in v.items()]
        return pairs
    if isinstance(dynamic_shapes, (list, tuple)):
        return list(zip([*args, *kwargs.values()], dynamic_shapes))
    return []


def _walk(value, spec, fake_of, names: dict[str, str]) -> None:
    if spec is None:
        return
    if isinstance(value, torch.Tensor):
        fake = fake_of.get(id(value))
        if fake is None:
            return
        dims = spec.items() if isinstance(spec, dict) else enumerate(spec) \
            if isinstance(spec, (list, tuple)) else ()
        for d, dim in dims:
            name = getattr(dim, "__name__", None)
            if not isinstance(name, str) or not isinstance(d, int) \
                    or not -fake.dim() <= d < fake.dim():
                continue
            expr = getattr(getattr(fake.shape[d], "node", None), "expr", None)
            if isinstance(expr, sympy.Symbol):
                names.setdefault(expr.name, name)
            elif hasattr(dim, "root") and expr is not None and len(expr.free_symbols) == 1:
                # a derived Dim (10 * samples): its one symbol is the root Dim's
                names.setdefault(next(iter(expr.free_symbols)).name, dim.root.__name__)
    elif isinstance(value, (list, tuple)) and isinstance(spec, (list, tuple)):
        for v, s in zip(value, spec):
            _walk(v, s, fake_of, names)
    elif isinstance(value, dict) and isinstance(spec, dict):
        for k, v in value.items():
            _walk(v, spec.get(k), fake_of, names)
