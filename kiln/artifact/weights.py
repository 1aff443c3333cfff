"""An artifact's weights.safetensors: every state tensor the plan reads, once.

Parameters, constants and mutable buffers (a KV cache, with what it holds now) are
stored by state-dict name. Tensors that are the same memory under two names (tied
embeddings) are stored once and restored as one tensor under both names, so an
update through one name is seen through the other, as in the original module.
Non-contiguous tensors are stored contiguous; one that is a permutation of a dense
layout (a transposed weight) is stored in its memory order and permuted back on
load, so it keeps its strides and matmuls on it round exactly as before.

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
        t = state[name].detach()
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


def load_weights(directory: Path, entry: dict, device: str) -> dict[str, torch.Tensor]:
    """The state dict of an artifact, on `device`; ArtifactError naming the file if bad."""
    path = directory / entry.get("file", WEIGHTS_FILE)
    if not path.is_file():
        raise ArtifactError(f"the artifact has no weights file {path}",
                            where=str(directory), hint=_RECOMPILE)
    expected: dict[str, dict] = entry["tensors"]
    try:
        f = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise ArtifactError(f"cannot read the weights file {path}: {e}",
                            hint="the file is truncated or corrupt; " + _RECOMPILE) from None
    with f:
        _check_header(f, path, expected)
        out: dict[str, torch.Tensor] = {}
        stored = [n for n, e in expected.items() if "same_as" not in e]
        with progress(total=len(stored), desc="loading weights", unit="tensor") as bar:
            for name in stored:
                t = _own_copy(f.get_tensor(name), device)
                order = expected[name].get("dim_order")
                if order is not None:
                    t = t.permute([order.index(d) for d in range(len(order))])
                out[name] = t
                bar.update(1)
    for name, e in expected.items():
        if "same_as" in e:
            out[name] = out[e["same_as"]]
    return out


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
    present = set(f.keys())
    for name, e in expected.items():
        if "same_as" in e:
            if e["same_as"] not in expected or "same_as" in expected[e["same_as"]]:
                raise ArtifactError(f"manifest entry for tensor {name!r} refers to "
                                    f"{e['same_as']!r}, which is not stored",
                                    where=str(path.parent / "manifest.json"), hint=_RECOMPILE)
            continue
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


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _st_dtype(code: str) -> torch.dtype | None:
    return _ST_DTYPES.get(code)
