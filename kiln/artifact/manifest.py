"""The DispatchPlan as readable JSON, and back: the heart of an artifact's manifest.json.

Everything the runtime needs is written out explicitly (symbols and bounds, values,
regions and their ops, state writes, const args, pytree specs, devices) so a loaded
plan is the same plan, and a person can read what was compiled. Op arguments are
JSON where JSON can say it exactly (ints, finite floats, bools, None, strings,
lists); everything else is a one-key object tagging its type:

    {"ref": "x"}  {"sym": "s0 + 1"}  {"float": "inf"}  {"tuple": [...]}
    {"dtype": "float32"}  {"device": "cpu"}  {"layout": "strided"}
    {"memory_format": "contiguous_format"}
"""

from __future__ import annotations

import json
import math

import torch

from kiln.errors import ArtifactError
from kiln.ir.plan import DispatchPlan, Op, Ref, Region, RegionKind, Role, Sym, TensorValue
from kiln.ir.symbolic import Bounds, parse, to_str

FORMAT_VERSION = 1

# Tagged types whose text is a torch attribute name, checked on the way back.
_TORCH_NAMED = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}


class ManifestFormatError(ValueError):
    """A manifest entry that cannot be decoded; load turns it into an ArtifactError."""


# ---- op arguments -------------------------------------------------------------------


def encode_arg(a, where: str):
    """One op argument as JSON; `where` names the op for the error on an unknown type."""
    if a is None or isinstance(a, (bool, str)):
        return a
    if isinstance(a, int):
        return int(a)
    if isinstance(a, float):
        return a if math.isfinite(a) else {"float": repr(a)}  # 'inf', '-inf', 'nan'
    if isinstance(a, Ref):
        return {"ref": a.name}
    if isinstance(a, Sym):
        return {"sym": to_str(a.expr)}
    if isinstance(a, tuple):
        return {"tuple": [encode_arg(x, where) for x in a]}
    if isinstance(a, list):
        return [encode_arg(x, where) for x in a]
    if isinstance(a, torch.device):
        return {"device": str(a)}
    for tag, cls in _TORCH_NAMED.items():
        if isinstance(a, cls):
            return {tag: str(a).removeprefix("torch.")}
    raise ArtifactError(
        f"cannot save {where}: it has an argument of type {type(a).__name__} ({a!r})",
        hint="this is a kiln limitation; please report it with the model that hit it",
    )


def decode_arg(j, int_args: frozenset[str] = frozenset()):
    """One op argument back; `int_args`: the plan's int-argument symbols (`parse`)."""
    if j is None or isinstance(j, (bool, int, float, str)):
        return j
    if isinstance(j, list):
        return [decode_arg(x, int_args) for x in j]
    if not isinstance(j, dict) or len(j) != 1:
        raise ManifestFormatError(f"unreadable op argument {j!r}")
    (tag, v), = j.items()
    if tag == "ref":
        return Ref(v)
    if tag == "sym":
        return Sym(parse(v, int_args))
    if tag == "float":
        return float(v)
    if tag == "tuple":
        return tuple(decode_arg(x, int_args) for x in v)
    if tag == "device":
        return torch.device(v)
    if tag in _TORCH_NAMED:
        x = getattr(torch, v, None)
        if not isinstance(x, _TORCH_NAMED[tag]):
            raise ManifestFormatError(f"unknown torch {tag} {v!r}")
        return x
    raise ManifestFormatError(f"unknown argument tag {tag!r}")


# ---- dtypes, shapes, values ---------------------------------------------------------


def encode_dtype(d: torch.dtype | None) -> str | None:
    return None if d is None else str(d).removeprefix("torch.")


def decode_dtype(s: str | None) -> torch.dtype | None:
    if s is None:
        return None
    d = getattr(torch, s, None)
    if not isinstance(d, torch.dtype):
        raise ManifestFormatError(f"unknown dtype {s!r}")
    return d


def encode_shape(shape) -> list | None:
    return None if shape is None else [d if isinstance(d, int) else to_str(d) for d in shape]


def decode_shape(j, int_args: frozenset[str] = frozenset()) -> tuple | None:
    if j is None:
        return None
    return tuple(d if isinstance(d, int) else parse(d, int_args) for d in j)


def _value(v: TensorValue) -> dict:
    d = {"shape": encode_shape(v.shape), "dtype": encode_dtype(v.dtype), "role": v.role.value}
    if v.target is not None:
        d["target"] = v.target
    return d


def _op(op: Op) -> dict:
    where = f"op %{op.name} ({op.target})"
    d = {"name": op.name, "target": op.target,
         "args": [encode_arg(a, where) for a in op.args],
         "kwargs": {k: encode_arg(v, where) for k, v in op.kwargs.items()},
         "shape": encode_shape(op.shape), "dtype": encode_dtype(op.dtype)}
    if op.where:
        d["where"] = op.where
    return d


def _region(r: Region) -> dict:
    d = {"name": r.name, "kind": r.kind.value, "device": r.device, "inputs": list(r.inputs),
         "outputs": list(r.outputs), "ops": [_op(o) for o in r.ops]}
    if r.inplace:
        d["inplace"] = dict(r.inplace)
    if r.notes:
        d["notes"] = list(r.notes)
    label = getattr(r, "label", None)
    if label:
        d["label"] = label
    if r.key_bounds:  # an attention region's mask envelope (dispatch/mask_envelope.py)
        d["key_bounds"] = list(r.key_bounds)
    return d


# ---- the plan -------------------------------------------------------------------------


def plan_to_json(plan: DispatchPlan) -> dict:
    j = {
        "symbols": {k: b.to_json() for k, b in plan.symbols.items()},
        "dim_names": dict(plan.dim_names),
        "devices": list(plan.devices),
        "user_inputs": list(plan.user_inputs),
        "outputs": list(plan.outputs),
        "state_writes": dict(plan.state_writes),
        # JSON object keys are strings: the flat argument index is written as text.
        "const_args": {str(i): encode_arg(v, f"constant argument {i}")
                       for i, v in plan.const_args.items()},
        "in_spec": json.loads(plan.in_spec) if plan.in_spec else None,
        "out_spec": json.loads(plan.out_spec) if plan.out_spec else None,
        "values": {n: _value(v) for n, v in plan.values.items()},
        "regions": [_region(r) for r in plan.regions],
    }
    if plan.size_args:  # dynamic int arguments; a manifest without stays as it was
        j["size_args"] = [[i, name, sym] for i, name, sym in plan.size_args]
        j["size_checks"] = [[to_str(d), rel, text] for d, rel, text in plan.size_checks]
    if plan.recv or plan.send:  # a pipeline stage; single-device manifests stay as they were
        j["recv"] = [[name, src] for name, src in plan.recv]
        j["send"] = [[name, list(dsts)] for name, dsts in plan.send]
    if plan.none_outputs:  # returned Nones; manifests without any stay as they were
        j["none_outputs"] = list(plan.none_outputs)
    return j


def _relation(rel) -> str:
    """A size check's relation, one the runtime knows (KeyError otherwise: a bad manifest)."""
    return {r: r for r in ("<=", "<", ">=", ">", "==", "!=")}[rel]


def plan_from_json(j: dict) -> DispatchPlan:
    """Rebuild the plan; raises ManifestFormatError (or KeyError/TypeError) on bad input.
    The int arguments' symbols are read back as torch made them, integers that may be
    0: read as positive, `Max(1, s)` would become `s`, 0 at s = 0 where eager has 1."""
    size_args = [(int(i), str(name), str(sym)) for i, name, sym in j.get("size_args", [])]
    ints = frozenset(sym for _, _, sym in size_args)
    values = {
        n: TensorValue(n, decode_shape(v["shape"], ints), decode_dtype(v["dtype"]),
                       Role(v["role"]), v.get("target"))
        for n, v in j["values"].items()
    }
    regions = []
    for r in j["regions"]:
        ops = [Op(o["name"], o["target"], tuple(decode_arg(a, ints) for a in o["args"]),
                  {k: decode_arg(v, ints) for k, v in o["kwargs"].items()},
                  decode_shape(o["shape"], ints), decode_dtype(o["dtype"]), o.get("where"))
               for o in r["ops"]]
        region = Region(r["name"], RegionKind(r["kind"]), ops, list(r["inputs"]),
                        list(r["outputs"]), dict(r.get("inplace", {})), list(r.get("notes", [])),
                        int(r.get("device", 0)))
        if "label" in r:
            region.label = r["label"]
        if "key_bounds" in r:
            region.key_bounds = tuple(r["key_bounds"])
        regions.append(region)
    return DispatchPlan(
        symbols={k: Bounds.from_json(b) for k, b in j["symbols"].items()},
        values=values,
        regions=regions,
        user_inputs=list(j["user_inputs"]),
        outputs=list(j["outputs"]),
        state_writes=dict(j["state_writes"]),
        const_args={int(i): decode_arg(v) for i, v in j["const_args"].items()},
        in_spec=json.dumps(j["in_spec"]) if j["in_spec"] is not None else "",
        out_spec=json.dumps(j["out_spec"]) if j["out_spec"] is not None else "",
        devices=list(j["devices"]),
        dim_names={str(k): str(v) for k, v in j.get("dim_names", {}).items()},
        recv=[(str(name), int(src)) for name, src in j.get("recv", [])],
        size_args=size_args,
        size_checks=[(parse(d, ints), _relation(rel), str(text))
                     for d, rel, text in j.get("size_checks", [])],
        send=[(str(name), tuple(int(d) for d in dsts)) for name, dsts in j.get("send", [])],
        none_outputs=[int(i) for i in j.get("none_outputs", [])],
    )
