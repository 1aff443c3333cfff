"""An artifact's weights.safetensors: every state tensor the plan reads, once.

Parameters, constants and mutable buffers (a KV cache, with what it holds now) are
stored by state-dict name. Tensors that are the same memory under two names (tied
embeddings) are stored once and restored as one tensor under both names, so an
update through one name is seen through the other, as in the original module.
Non-contiguous tensors are stored contiguous; one that is a permutation of a dense
layout (a transposed weight) is stored in its memory order and permuted back on
load, so it keeps its strides and matmuls on it round exactly as before.

Modules saved together (kiln.save_modules: an LLM's prefill and decode) share one
file: each manifest entry names the file's tensor it reads ("key", default its own
name), so a tensor both modules read is stored once, and loading the modules with one
`shared` dict gives both the same tensor again (a KV-cache write by one is read by the
other). An "empty" entry (a KV cache saved as its shape alone) loads as zeros.

Loading checks everything it can before reading any tensor data (the file exists,
its header parses, it is as long as the header says, every tensor is present with
the shape and dtype the manifest records), so a bad file fails fast and leaves
nothing half-loaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln.artifact.manifest import decode_dtype, encode_dtype
from kiln.errors import ArtifactError
from kiln.progress import progress

WEIGHTS_FILE = "weights.safetensors"

_RECOMPILE = "recompile the model with `kiln compile` (or CompiledModule.save) to rewrite it"


def _identity(t: torch.Tensor) -> tuple:
    """Two tensors with the same identity are the same memory seen the same way."""
    return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype)


def save_weights(state: dict[str, torch.Tensor], directory: Path) -> dict:
    """Write `state` to directory/weights.safetensors; returns the manifest's weights entry."""
    first: dict[tuple, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    for name in sorted(state):
        t = _storable(name, state[name].detach())
        entry = {"shape": list(t.shape), "dtype": encode_dtype(t.dtype)}
        key = _identity(t)
        if key in first and t.numel() > 0:
            entry["same_as"] = first[key]
        else:
            first.setdefault(key, name)
            order = _dense_order(t)
            if order is not None:
                entry["dim_order"] = order
                t = t.permute(order)
            tensors[name] = t.contiguous().cpu()
        entries[name] = entry
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return {"file": WEIGHTS_FILE, "tensors": entries}


def save_shared_weights(states: dict[str, dict[str, torch.Tensor]],
                        empty: dict[str, set[str]], directory: Path) -> dict[str, dict]:
    """Write the state of several modules to one directory/weights.safetensors.

    A tensor the modules share (the same memory, or a constant with the same name and
    equal values) is stored once under one key; a tensor named in `empty[module]` is
    recorded by shape alone, under every name. Returns each module's `tensors` entry.
    """
    empty_ids = {_identity(states[m][n]) for m, names in empty.items() for n in names}
    keys: dict[tuple, str] = {}  # identity -> key
    owner: dict[str, torch.Tensor] = {}  # key -> the tensor first seen under it
    stored: dict[str, torch.Tensor] = {}
    storages: set[int] = set()  # the memory of the tensors in `stored`
    entries: dict[str, dict] = {}
    for module, state in states.items():
        mine = entries[module] = {}
        for name in sorted(state):
            t = _storable(name, state[name].detach())
            ident, sized = _identity(t), t.numel() > 0
            is_empty = sized and ident in empty_ids
            key = keys.get(ident) if sized else None
            if key is None and name in stored and not is_empty and _equal(owner[name], t):
                key = name  # the same constant, folded by each module's compile
            order = _dense_order(t)
            if key is None:
                key = name if name not in owner else f"{module}/{name}"
                owner[key] = t
                if sized:
                    keys[ident] = key
                if not is_empty:
                    stored[key] = _own_storage(
                        (t.permute(order) if order else t).contiguous().cpu(), storages)
            entry = {"shape": list(t.shape), "dtype": encode_dtype(t.dtype)}
            if order is not None:
                entry["dim_order"] = order
            if key != name:
                entry["key"] = key
            if is_empty:
                entry["empty"] = True
            mine[name] = entry
    save_file(stored, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return entries


def _storable(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t`, when safetensors can write its dtype (it raised a bare KeyError for others)."""
    if t.dtype not in _ST_DTYPES.values():
        raise ArtifactError(f"tensor {name!r} is {encode_dtype(t.dtype)}, which a "
                            "safetensors file cannot hold",
                            hint="safetensors holds real, integer, bool, fp8 and complex64 "
                            "tensors: keep a complex128 table as complex64 (or as "
                            "torch.view_as_real's float64 pairs)")
    return t


def _own_storage(t: torch.Tensor, storages: set[int]) -> torch.Tensor:
    """`t`, copied if it shares memory with a tensor already stored (a weight and its
    transpose): safetensors writes each tensor's own bytes."""
    if t.untyped_storage().data_ptr() in storages:
        t = t.clone()
    storages.add(t.untyped_storage().data_ptr())
    return t


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
            and a.device == b.device and torch.equal(a, b))


def _dense_order(t: torch.Tensor) -> list[int] | None:
    """The dim order (outermost first) in which a non-contiguous `t` is dense, if any."""
    if t.is_contiguous() or t.dim() < 2:
        return None
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return order if t.permute(order).is_contiguous() else None


def _stored_shape(entry: dict) -> list[int]:
    order = entry.get("dim_order")
    shape = list(entry["shape"])
    return shape if order is None else [shape[d] for d in order]


def load_weights(directory: Path, entry: dict, device: str,
                 shared: dict | None = None) -> dict[str, torch.Tensor]:
    """The state dict of an artifact, on `device`; ArtifactError naming the file if bad.

    `shared` ((file, key) -> tensor), passed to the loads of modules saved together,
    makes a tensor they share one tensor again: read (or zeroed) once.
    """
    path = directory / entry.get("file", WEIGHTS_FILE)
    expected: dict[str, dict] = entry["tensors"]
    _check_same_as(expected, directory)
    shared = {} if shared is None else shared
    file_id = str(path.resolve())
    todo = [n for n, e in expected.items() if "same_as" not in e
            and (file_id, e.get("key", n)) not in shared]
    if any(not expected[n].get("empty") for n in todo):
        _read(path, {n: expected[n] for n in todo}, device, shared, file_id)
    out: dict[str, torch.Tensor] = {}
    for name, e in expected.items():
        if "same_as" in e:
            continue
        key = (file_id, e.get("key", name))
        if key not in shared:  # an empty entry: a KV cache saved as its shape
            shape, dtype = _stored_shape(e), decode_dtype(e["dtype"])
            shared[key] = _unpermute(torch.zeros(shape, dtype=dtype, device=device), e)
        t = shared[key]
        if list(t.shape) != list(e["shape"]) or t.dtype != decode_dtype(e["dtype"]):
            raise ArtifactError(f"tensor {key[1]!r} of {path} is read as "
                                f"{e['dtype']}{e['shape']} by one module and as "
                                f"{encode_dtype(t.dtype)}{list(t.shape)} by another",
                                where=str(directory / "manifest.json"), hint=_RECOMPILE)
        out[name] = t
    for name, e in expected.items():
        if "same_as" in e:
            out[name] = out[e["same_as"]]
    return out


def _read(path: Path, expected: dict[str, dict], device: str, shared: dict,
          file_id: str) -> None:
    """Read the tensors `expected` lists (not empty ones) from `path` into `shared`."""
    if not path.is_file():
        raise ArtifactError(f"the artifact has no weights file {path}",
                            where=str(path.parent), hint=_RECOMPILE)
    try:
        f = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise ArtifactError(f"cannot read the weights file {path}: {e}",
                            hint="the file is truncated or corrupt; " + _RECOMPILE) from None
    wanted = {e.get("key", n): e for n, e in expected.items() if not e.get("empty")}
    with f:
        _check_header(f, path, wanted)
        new = {}
        with progress(total=len(wanted), desc="loading weights", unit="tensor") as bar:
            for key, e in wanted.items():
                new[(file_id, key)] = _unpermute(_own_copy(f.get_tensor(key), device), e)
                bar.update(1)
    shared.update(new)  # only once all of them were read


def _unpermute(t: torch.Tensor, entry: dict) -> torch.Tensor:
    """A tensor stored in its memory order, back in its logical dim order."""
    order = entry.get("dim_order")
    return t if order is None else t.permute([order.index(d) for d in range(len(order))])


def _own_copy(t: torch.Tensor, device: str) -> torch.Tensor:
    """`t` in fresh memory from torch's allocator on `device`.

    safetensors hands out tensors at the file's (unaligned) offsets; CPU BLAS picks
    its code path by alignment, so an unaligned weight can round differently from
    the module that was saved. A fresh allocation is aligned like the original.
    """
    if torch.device(device).type != "cpu":
        return t.to(device)
    fresh = torch.empty_like(t, memory_format=torch.contiguous_format)
    fresh.copy_(t)
    return fresh


def _check_header(f, path: Path, expected: dict[str, dict]) -> None:
    """Every tensor `expected` lists (by its key in the file) is there, as recorded."""
    present = set(f.keys())
    for name, e in expected.items():
        if name not in present:
            raise ArtifactError(f"tensor {name!r} is missing from {path}", hint=_RECOMPILE)
        sl = f.get_slice(name)
        shape, dtype = list(sl.get_shape()), _st_dtype(sl.get_dtype())
        want_shape, want_dtype = _stored_shape(e), decode_dtype(e["dtype"])
        if shape != want_shape or dtype != want_dtype:
            raise ArtifactError(
                f"tensor {name!r} in {path} is {encode_dtype(dtype)}{shape}, the compiled "
                f"plan needs {e['dtype']}{want_shape}",
                hint="the weights file does not belong to this manifest; " + _RECOMPILE,
            )


def _check_same_as(expected: dict[str, dict], where: Path) -> None:
    for name, e in expected.items():
        if "same_as" in e and (e["same_as"] not in expected
                               or "same_as" in expected[e["same_as"]]):
            raise ArtifactError(f"manifest entry for tensor {name!r} refers to "
                                f"{e['same_as']!r}, which is not stored",
                                where=str(where / "manifest.json"), hint=_RECOMPILE)


# Every dtype safetensors writes for torch, so whatever a plan holds loads back: Meta's
# Llama keeps its RoPE table as complex64 (freqs_cis), which a load had refused as "None".
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
}


def _st_dtype(code: str) -> torch.dtype | None:
    return _ST_DTYPES.get(code)
