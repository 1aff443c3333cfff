"""Compiled modules that share weights, saved in one directory and loaded back sharing them.

    llm.kiln/
      modules.json         {"format": "kiln-modules", "format_version": 1, "modules": [...]}
      weights.safetensors  every tensor any module reads, once (see weights.py)
      prefill/             one artifact per module: its manifest.json (whose weights
      decode/              entry reads ../weights.safetensors) and its GPU kernels
      ...                  other files the caller keeps beside them (a tokenizer)

Why: an LLM is compiled twice from one model (a prefill and a decode module), and
both read the model's own tensors; saved one by one they would double the weights on
disk and in memory, and each would get its own KV cache, so decode would not see what
prefill wrote. Saved together they are stored once and loaded once. Each module's
directory is still an artifact of its own (kiln.load reads it alone).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kiln.artifact.load import Artifact, load, read_manifest
from kiln.artifact.save import (
    GROUP_FILE,
    MANIFEST_FILE,
    build_manifest,
    dumps,
    versions,
    write_directory,
)
from kiln.artifact.weights import WEIGHTS_FILE, save_shared_weights
from kiln.errors import ArgumentError, ArtifactError
from kiln.ir.plan import Role
from kiln.progress import phase

GROUP_FORMAT = "kiln-modules"
GROUP_VERSION = 1

_RESAVE = "save the modules again (an LLM: `kiln compile --model CHECKPOINT -o DIR`)"


def save_group(modules: dict, path, *, empty_state: bool = False,
               files: dict[str, str | bytes | Path] | None = None) -> Path:
    """Write `modules` (name -> CompiledModule) to the directory `path`, their shared
    tensors once. empty_state=True saves the buffers they update in place (KV caches)
    as shapes alone: they load as zeros. `files` (name -> text, bytes or a file to
    copy) are written beside them. The directory appears whole or not at all."""
    files = dict(files or {})
    _check_names(modules, files)

    def write(tmp: Path) -> None:
        states = {n: m.state for n, m in modules.items()}
        empty = {n: _updated_state(m) if empty_state else set() for n, m in modules.items()}
        entries = save_shared_weights(states, empty, tmp)
        for name, module in modules.items():
            d = tmp / name
            d.mkdir()
            manifest = build_manifest(module, d)
            manifest["weights"] = {"file": f"../{WEIGHTS_FILE}", "tensors": entries[name]}
            (d / MANIFEST_FILE).write_text(dumps(manifest) + "\n")
        for name, content in files.items():
            if isinstance(content, Path):
                shutil.copyfile(content, tmp / name)
            elif isinstance(content, bytes):
                (tmp / name).write_bytes(content)
            else:
                (tmp / name).write_text(content)
        body = {"format": GROUP_FORMAT, "format_version": GROUP_VERSION,
                "versions": versions(), "modules": list(modules)}
        (tmp / GROUP_FILE).write_text(json.dumps(body, indent=1) + "\n")

    return write_directory(path, write, replaces=(GROUP_FILE, MANIFEST_FILE))


def _check_names(modules: dict, files: dict) -> None:
    if not modules:
        raise ArgumentError("save_modules needs at least one module")
    taken = {GROUP_FILE, WEIGHTS_FILE}
    for name in list(modules) + list(files):
        if not isinstance(name, str) or not name or name in taken or "/" in name \
                or name.startswith("."):
            raise ArgumentError(f"{name!r} cannot name a module or file of a saved group",
                                hint="use plain names such as 'prefill', 'tokenizer.json' "
                                f"(not {', '.join(sorted(taken))})")
        taken.add(name)
    for name, m in modules.items():
        if getattr(m, "parallel", None) is not None and m.parallel.world_size > 1:
            raise ArgumentError(f"module {name!r} is one rank of a multi-device plan",
                                hint="save a multi-device module on its own with "
                                "CompiledModule.save from every rank")


def _updated_state(module) -> set[str]:
    """State names the module writes in place (Role.STATE: KV caches, recurrent state)."""
    return {v.target for v in module.plan.values.values()
            if v.role == Role.STATE and v.target is not None}


def read_group(directory: Path) -> list[str]:
    """The module names of the group saved at `directory`; ArtifactError if it is none."""
    path = directory / GROUP_FILE
    if not path.is_file():
        what = "does not exist" if not directory.exists() else f"has no {GROUP_FILE}"
        raise ArtifactError(f"{directory} is not a set of saved kiln modules: it {what}",
                            hint="pass the directory written by kiln.save_modules")
    try:
        body = json.loads(path.read_text())
        if not isinstance(body, dict) or body.get("format") != GROUP_FORMAT:
            raise ValueError("it is not a kiln-modules manifest")
        version = body.get("format_version")
        names = [str(n) for n in body["modules"]]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ArtifactError(f"cannot read {path}: {e}", hint="the file is corrupt; "
                            + _RESAVE) from None
    if version != GROUP_VERSION:
        raise ArtifactError(f"{path} has format version {version}; this kiln reads "
                            f"version {GROUP_VERSION}", hint=_RESAVE + " with this kiln")
    return names


def load_group(path, target=None) -> dict[str, Artifact]:
    """Every module of the group at `path`, their shared tensors one tensor each."""
    directory = Path(path)
    names = read_group(directory)
    for name in names:
        if not (directory / name / MANIFEST_FILE).is_file():
            raise ArtifactError(f"{directory} lacks module {name!r} ({name}/{MANIFEST_FILE}), "
                                f"which {GROUP_FILE} lists", hint="the directory is "
                                "incomplete; " + _RESAVE)
        read_manifest(directory / name)  # every manifest's format, before any weight
    shared: dict = {}
    loaded = {}
    for name in names:
        with phase(name):
            loaded[name] = load(directory / name, target, shared=shared)
    return loaded
