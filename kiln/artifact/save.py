"""Save a compiled module as an artifact directory that loads without recompiling.

    model.kiln/
      manifest.json        format version, versions, target, the whole DispatchPlan,
                           the memory plan's slots, each region's kernel
      weights.safetensors  every state tensor the plan reads (see weights.py)
      kernels/             compiled GPU binaries (GPU targets only; Binary.save)

The directory is written next to its final place and moved there at the end, so a
failed save never leaves a half-written artifact where a good one was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from kiln.artifact.manifest import FORMAT_VERSION, plan_to_json
from kiln.artifact.paths import artifact_path
from kiln.artifact.weights import save_weights
from kiln.errors import ArtifactError

MANIFEST_FILE = "manifest.json"
GROUP_FILE = "modules.json"  # modules saved together (group.py)
KERNELS_DIR = "kernels"
FORMAT_NAME = "kiln-artifact"


def versions() -> dict[str, str]:
    import triton

    from kiln.version import __version__

    return {"kiln": __version__, "torch": torch.__version__, "triton": triton.__version__}


def _kernel_entry(kernel, kernels_dir: Path, written: dict[str, dict]) -> dict:
    """A region's kernel in the manifest; its binary is written once per distinct binary
    (an 8B's ~780 regions run ~34 kernels), named by its content, which `written`
    (file stem -> manifest entry) remembers. A size switch (a decode batch's two ends,
    each its own kernel) holds its two kernels' entries."""
    entry = kernel.to_json()
    if kernel.kind == "switch":
        entry["low"] = _kernel_entry(kernel.low, kernels_dir, written)
        entry["high"] = _kernel_entry(kernel.high, kernels_dir, written)
        return entry
    binary = getattr(kernel, "binary", None)
    if binary is not None:
        code = binary.asm[binary.binary_ext]
        digest = hashlib.sha256(code if isinstance(code, bytes) else code.encode())
        digest.update(json.dumps(binary.metadata, sort_keys=True, default=str).encode())
        stem = f"{binary.name}-{digest.hexdigest()[:16]}"
        if stem not in written:
            written[stem] = binary.save(kernels_dir, stem)
        entry["binary"] = written[stem]
    return entry


def _program_entries(program, directory: Path, written: dict[str, dict]) -> dict:
    """A Program's plan, memory plan and kernels, as the manifest holds them."""
    return {
        "plan": plan_to_json(program.plan),
        "memory": program.mem.to_json(),
        "kernels": {r.name: _kernel_entry(program.kplan.kernels[r.name],
                                          directory / KERNELS_DIR, written)
                    for r in program.plan.regions},
    }


def build_manifest(module, directory: Path) -> dict:
    """The manifest of `module` (a CompiledModule); writes kernel binaries as it goes.
    A narrow version (runtime/program.py) is kept beside the plan under "narrow", with
    the dim and the largest size it runs; it reads the same weights."""
    program = module.program
    written: dict[str, dict] = {}
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "versions": versions(),
        "target": dataclasses.asdict(program.kplan.target),
        "example_sizes": dict(getattr(module, "example_sizes", None) or {}),
        **_program_entries(program, directory, written),
    }
    narrow = program.narrow
    if narrow is not None:
        manifest["narrow"] = {"symbol": narrow.symbol, "max": narrow.hi,
                              **_program_entries(narrow.program, directory, written)}
    return manifest


def save(module, path) -> Path:
    """Write `module` to the directory `path` (replacing an artifact already there)."""
    def write(tmp: Path) -> None:
        manifest = build_manifest(module, tmp)
        manifest["weights"] = save_weights(module.state, tmp)
        (tmp / MANIFEST_FILE).write_text(dumps(manifest) + "\n")

    return write_directory(path, write)


def write_directory(path, write, replaces: tuple[str, ...] = (MANIFEST_FILE,)) -> Path:
    """Make the directory `path` by `write(tmp)` into a sibling and renaming it into place.

    An existing `path` is replaced only if it is empty or holds one of the files in
    `replaces` (it is a kiln artifact): a user's other directory is never deleted.
    """
    final = artifact_path(path)
    if final.exists() and not any((final / f).is_file() for f in replaces):
        what = "a file" if not final.is_dir() else "a directory that is not a kiln artifact"
        if final.is_file() or any(final.iterdir()):
            raise ArtifactError(f"cannot save to {final}: it is {what}",
                                hint="choose a new path (e.g. model.kiln) or remove it first")
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:  # a file where a parent directory should be, no permission
        raise _cannot_write(final, e) from None
    try:
        write(tmp)
        _replace(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # the disk filled up, the directory went away
            raise _cannot_write(final, e) from e
        raise
    return final


def _cannot_write(final: Path, e: OSError) -> ArtifactError:
    why = e.strerror or str(e)
    if isinstance(e, (FileExistsError, NotADirectoryError)):
        why = "a file is in the way of its directory"
    return ArtifactError(f"cannot save to {final}: {why}", where=e.filename and str(e.filename),
                         hint="choose a path in a writable directory (e.g. model.kiln)")


def dumps(obj, indent: str = "") -> str:
    """Indented JSON that keeps short lists and objects (shapes, args, bounds) on one line."""
    flat = json.dumps(obj)
    if len(flat) + len(indent) <= 96 or not isinstance(obj, (dict, list)) or not obj:
        return flat
    inner = indent + "  "
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(str(k))}: {dumps(v, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    items = [inner + dumps(v, inner) for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + indent + "]"


def _replace(new: Path, final: Path) -> None:
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        final.rename(old)
    new.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
