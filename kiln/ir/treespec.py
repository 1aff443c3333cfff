"""Argument and output structures (pytree TreeSpecs) as text that survives a save.

torch's own `treespec_dumps` refuses namedtuples it has no registered name for, which
includes what `torch.topk`, `torch.sort` and `x.max(dim=...)` return; a model returning
one must still compile, save and load. Those nodes are written as their type's import
path and field names (and rebuilt as that type when it imports, or as an equivalent
namedtuple when it does not, e.g. a class defined in a script); everything else is left
to torch's format, which older artifacts hold throughout. Dataclasses (registered with
torch.export when a model returns one, `register_dataclass`) are written the same way
and rebuilt as themselves, or as a namedtuple of their fields when they do not import.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import json

import torch.utils._pytree as pytree

_MARK = "kiln-treespec"


def dumps(spec: pytree.TreeSpec) -> str:
    return json.dumps({_MARK: 1, "tree": _encode(spec)})


def loads(text: str) -> pytree.TreeSpec:
    data = json.loads(text)
    if isinstance(data, dict) and _MARK in data:
        return pytree.tree_flatten(_build(data["tree"]))[1]
    return pytree.treespec_loads(text)


def register_dataclass(cls, path: str | None = None) -> bool:
    """Make a dataclass a pytree node (once); False if `cls` is no dataclass."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return False
    if cls not in pytree.SUPPORTED_NODES:
        import torch.export

        torch.export.register_dataclass(
            cls, serialized_type_name=path or f"{cls.__module__}:{cls.__qualname__}")
    return True


def _children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    return list(spec.children()) if hasattr(spec, "children") else list(spec.children_specs)


def _encode(spec: pytree.TreeSpec) -> dict:
    if spec.is_leaf():
        return {"leaf": True}
    kids = [_encode(c) for c in _children(spec)]
    t = spec.type
    if t is tuple or t is list:
        return {"seq": t.__name__, "children": kids}
    if t is dict:
        return {"dict": [_key(k) for k in spec.context], "children": kids}
    if isinstance(t, type) and issubclass(t, dict):  # transformers' ModelOutput, ...
        return {"mapping": f"{t.__module__}:{t.__qualname__}",
                "dict": [_key(k) for k in spec.context], "children": kids}
    if t is type(None):
        return {"none": True}
    if t is collections.namedtuple:  # pytree's namedtuple node: the class is the context
        t = spec.context
    if isinstance(t, type) and dataclasses.is_dataclass(t):
        names, nones = spec.context
        return {"dataclass": f"{t.__module__}:{t.__qualname__}", "fields": list(names),
                "nones": list(nones), "children": kids}
    if isinstance(t, type) and _is_named_sequence(t):
        return {"named": f"{t.__module__}:{t.__qualname__}", "fields": _fields(t),
                "children": kids}
    return {"torch": pytree.treespec_dumps(spec)}  # raises if torch cannot either


def _key(k):
    if not isinstance(k, str | int):
        raise TypeError(f"dict key {k!r} cannot be saved")
    return k


def _is_named_sequence(t: type) -> bool:
    """A namedtuple, or one of torch's structseqs (torch.return_types.*)."""
    return issubclass(t, tuple) and (hasattr(t, "_fields") or hasattr(t, "n_fields"))


def _fields(t: type) -> list[str]:
    if hasattr(t, "_fields"):
        return list(t._fields)
    return list(getattr(t, "__match_args__", ()))


def _build(node: dict):
    """A dummy object of the encoded structure (leaves are 0) to flatten into a spec."""
    if "leaf" in node:
        return 0
    if "none" in node:
        return None
    if "torch" in node:
        return pytree.tree_unflatten([0] * pytree.treespec_loads(node["torch"]).num_leaves,
                                     pytree.treespec_loads(node["torch"]))
    kids = [_build(c) for c in node["children"]]
    if "dataclass" in node:
        values = dict(zip(node["fields"], kids)) | dict.fromkeys(node["nones"])
        cls = _import(node["dataclass"])
        if register_dataclass(cls, node["dataclass"]):
            return cls(**values)
        # not importable here (a script's class): a namedtuple of its tensor fields
        name = node["dataclass"].rpartition(":")[2].replace(".", "_")
        return collections.namedtuple(name, node["fields"])(*kids)
    if "seq" in node:
        return tuple(kids) if node["seq"] == "tuple" else kids
    if "dict" in node:
        items = dict(zip(node["dict"], kids))
        cls = _import(node["mapping"]) if "mapping" in node else None
        return cls(**items) if cls is not None else items
    cls = _import(node["named"])
    if cls is None:
        name = node["named"].rpartition(":")[2].replace(".", "_").replace("<", "") \
            .replace(">", "")
        cls = collections.namedtuple(name, node["fields"] or [f"f{i}" for i in
                                                               range(len(kids))])
    return cls(*kids) if hasattr(cls, "_fields") else cls(kids)


def _import(path: str):
    module, _, qualname = path.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) else None
