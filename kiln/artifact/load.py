"""Load an artifact: rebuild the Program from its manifest, with no export and no passes.

Every problem with the directory (missing, unreadable or foreign manifest, another
format version, a plan that does not verify, missing or mismatched weights, kernel
binaries from another Triton) is an ArtifactError naming the file and what to do.
All of it is checked and built in local variables and handed back only at the end,
so a failed load leaves nothing half-loaded.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.artifact.manifest import (
    FORMAT_VERSION,
    ManifestFormatError,
    decode_dtype,
    plan_from_json,
)
from kiln.artifact.paths import artifact_path
from kiln.artifact.save import FORMAT_NAME, GROUP_FILE, KERNELS_DIR, MANIFEST_FILE, versions
from kiln.artifact.weights import load_weights
from kiln.codegen.kernel_plan import KernelPlan
from kiln.codegen.size_switch import SizeSwitch
from kiln.codegen.torch_kernel import TorchKernel
from kiln.errors import ArtifactError
from kiln.ir.ops import category
from kiln.ir.plan import DispatchPlan
from kiln.ir.printer import dtype_str
from kiln.ir.symbolic import numel
from kiln.ir.verify import verify_plan
from kiln.progress import phase
from kiln.runtime.memory_plan import MemoryPlan, Slot, lifetimes
from kiln.runtime.program import NarrowVersion, Program
from kiln.target import Target, get_target

log = logging.getLogger("kiln.artifact")

_RECOMPILE = "recompile the model with `kiln compile MODEL -o DIR` to write a fresh artifact"


@dataclass
class Artifact:
    """What load gives kiln.load to wrap in a CompiledModule."""

    program: Program
    state: dict[str, torch.Tensor]
    example_sizes: dict[str, int]
    versions: dict[str, str]


def read_manifest(directory: Path) -> dict:
    if not directory.exists():
        raise ArtifactError(f"no kiln artifact at {directory}: it does not exist",
                            hint="pass the directory written by `kiln compile -o DIR` or "
                            "CompiledModule.save(DIR)")
    if not directory.is_dir():
        raise ArtifactError(f"{directory} is a file, not a kiln artifact directory",
                            hint="a kiln artifact is the directory written by `kiln compile`")
    path = directory / MANIFEST_FILE
    if not path.is_file() and (directory / GROUP_FILE).is_file():
        raise ArtifactError(f"{directory} holds several compiled modules sharing weights "
                            "(kiln.save_modules), not one",
                            hint="load them with kiln.load_modules(DIR) (a saved LLM: "
                            "kiln.models.load(DIR) or `kiln generate DIR`); each member "
                            "directory (DIR/decode) is an artifact of its own")
    if not path.is_file():
        raise ArtifactError(f"{directory} is not a kiln artifact: it has no {MANIFEST_FILE}",
                            hint=_RECOMPILE)
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"cannot read {path}: {e}", hint="the manifest is corrupt; "
                            + _RECOMPILE) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ArtifactError(f"{path} is not a kiln artifact manifest", hint=_RECOMPILE)
    found = manifest.get("format_version")
    if found != FORMAT_VERSION:
        written_by = manifest.get("versions", {}).get("kiln", "another version")
        raise ArtifactError(
            f"{path} has artifact format version {found} (written by kiln {written_by}); "
            f"this kiln reads version {FORMAT_VERSION}",
            hint=_RECOMPILE + " with this kiln",
        )
    return manifest


def _target(saved: dict, tgt: Target | None) -> Target:
    compiled_for = Target(**saved)
    if tgt is None:
        return compiled_for
    if tgt.name != compiled_for.name:
        raise ArtifactError(
            f"the artifact was compiled for {compiled_for.name}, not {tgt.name}",
            hint=f"load it with target={compiled_for.name!r} (or none), or recompile "
            f"with --target {tgt.name}",
        )
    return tgt


def _kernel(entry: dict, region, target: Target, directory: Path, binaries: dict,
            plan: DispatchPlan, within: str | None = None):
    """The region's kernel; `binaries` (files -> Binary) gives regions that run one
    binary one Binary, so its module is loaded onto the GPU once. `within`: the size
    switch this entry is one side of ("low" or "high"), if any."""
    if not isinstance(entry, dict):
        raise ManifestFormatError(f"region {region.name}'s kernel entry "
                                  f"{_side(within)}is not an object: {entry!r:.60}")
    kind = entry.get("kind")
    if kind == "switch":
        if within is not None:
            raise ManifestFormatError(f"region {region.name}'s size switch has another "
                                      f"switch as its {within} kernel; kiln makes none")
        return _size_switch(entry, region, target, directory, binaries, plan)
    if kind == "torch":
        return TorchKernel(region, target.torch_device)
    if kind == "triton":
        from kiln.codegen.build.compiler import Binary
        from kiln.codegen.build.spec import Config, KernelSpec
        from kiln.codegen.build.triton_kernel import TritonKernel

        spec = KernelSpec.from_json(entry["spec"], plan.int_symbols)
        config = Config.from_json(entry["config"])
        if target.backend == "interpret":
            return TritonKernel(region, spec, config, interpret=True)
        if "binary" not in entry:
            raise ManifestFormatError(f"region {region.name}'s kernel has no compiled binary")
        files = json.dumps(entry["binary"].get("files"), sort_keys=True)
        try:
            binary = binaries.get(files)
            if binary is None:
                binary = binaries[files] = Binary.load(directory / KERNELS_DIR,
                                                       entry["binary"])
        except (OSError, ValueError) as e:  # missing, or unreadable JSON (not the manifest)
            raise ArtifactError(f"cannot read the kernel binary of region {region.name}: {e}",
                                where=str(directory / KERNELS_DIR), hint=_RECOMPILE) from None
        return TritonKernel(region, spec, config, binary)
    raise ManifestFormatError(f"region {region.name} has a kernel {_side(within)}of unknown "
                              f"kind {kind!r}")


def _side(within: str | None) -> str:
    return "" if within is None else f"(its size switch's {within} side) "


def _size_switch(entry: dict, region, target: Target, directory: Path, binaries: dict,
                 plan: DispatchPlan) -> SizeSwitch:
    """A decode batch's two kernels (codegen/size_switch.py) and the sizes they split at."""
    sizes = entry.get("low_sizes")
    if not isinstance(sizes, dict) or not sizes:
        raise ManifestFormatError(f"region {region.name}'s size switch has no low_sizes "
                                  "(dim -> the largest size its low kernel runs)")
    for dim, n in sizes.items():
        if dim not in plan.symbols:
            raise ManifestFormatError(f"region {region.name}'s size switch switches on "
                                      f"{dim!r}, which is not one of the plan's dims "
                                      f"({', '.join(sorted(plan.symbols)) or 'none'})")
        if not isinstance(n, int) or isinstance(n, bool):
            raise ManifestFormatError(f"region {region.name}'s size switch gives {dim} the "
                                      f"size {n!r}, not an integer")
    low, high = (_kernel(entry.get(side), region, target, directory, binaries, plan, side)
                 for side in ("low", "high"))
    return SizeSwitch(region, low, high, sizes)


def _memory_plan(plan: DispatchPlan, slots: list[list[str]]) -> MemoryPlan:
    live = lifetimes(plan)
    assigned = [v for s in slots for v in s]
    if sorted(assigned) != sorted(live):
        raise ManifestFormatError("the memory plan's slots do not cover the plan's "
                                  "intermediates exactly once")
    for s in slots:
        spans = sorted(live[v] for v in s)
        if any(a[1] >= b[0] for a, b in zip(spans, spans[1:])):
            raise ManifestFormatError(f"memory slot {s} holds values alive at the same time")
    nbytes = {v: numel(plan.values[v].shape) * plan.values[v].itemsize for v in live}
    return MemoryPlan([Slot(list(s), [live[v] for v in s]) for s in slots],
                      {v: i for i, s in enumerate(slots) for v in s}, nbytes)


def _check_state(plan: DispatchPlan, tensors: dict[str, dict], directory: Path) -> None:
    """Every weight the plan reads is listed in the manifest with the plan's shape and dtype."""
    for v in plan.values.values():
        if v.target is None:
            continue
        t = tensors.get(v.target)
        if t is None:
            raise ArtifactError(f"the plan reads {v.target}, which the weights file lacks",
                                where=str(directory / MANIFEST_FILE), hint=_RECOMPILE)
        shape, dtype = list(t["shape"]), decode_dtype(t["dtype"])
        if shape != list(v.shape) or dtype != v.dtype:
            raise ArtifactError(
                f"weight {v.target!r} is listed as {t['dtype']}{shape}, the plan reads "
                f"{dtype_str(v.dtype)}{list(v.shape)}",
                where=str(directory / MANIFEST_FILE), hint=_RECOMPILE,
            )


def _check_versions(manifest: dict, kernels: dict) -> None:
    saved, here = manifest.get("versions", {}), versions()
    has_binaries = any(map(_has_binary, kernels.values()))
    if has_binaries and _minor(saved.get("triton")) != _minor(here["triton"]):
        raise ArtifactError(
            f"the artifact's GPU kernels were compiled by Triton {saved.get('triton')}; "
            f"this machine has Triton {here['triton']}",
            hint=_RECOMPILE + " on this machine",
        )
    for lib in ("kiln", "torch"):
        if saved.get(lib) != here[lib]:
            log.info("artifact written with %s %s, loading with %s", lib, saved.get(lib),
                     here[lib])


def _has_binary(entry) -> bool:
    """Whether a kernel entry (a size switch's sides too) holds a compiled binary."""
    return isinstance(entry, dict) and ("binary" in entry or any(
        _has_binary(entry.get(side)) for side in ("low", "high")))


def _minor(version: str | None) -> str | None:
    return None if version is None else ".".join(version.split(".")[:2])


def _weights_device(target: Target) -> str:
    """Where to put the weights: the target's device, or the CPU when it is absent here
    (a GPU artifact opened on a CPU machine can still be explained, not run)."""
    if target.torch_device == "cuda" and not torch.cuda.is_available():
        return "cpu"
    return target.torch_device


def _check_ops_registered(plan: DispatchPlan, where: str) -> None:
    """A library's custom op the plan runs (kiln falls back to it as it is) must be
    registered in this process too: its library is imported before kiln.load."""
    missing = {}
    for region in plan.regions:
        for op in region.ops:
            ns = op.target.split(".")[0]
            if ns not in ("aten", "kiln", "getitem") and category(op.target) is None:
                missing.setdefault(ns, set()).add(op.target)
    if missing:
        ops = "; ".join(f"{', '.join(sorted(names))} (namespace {ns!r})"
                        for ns, names in sorted(missing.items()))
        raise ArtifactError(f"{where}: the module runs custom ops this process has not "
                            f"registered: {ops}",
                            hint="import the library that defines them (the one the model "
                                 "imported, e.g. transformers) before kiln.load")


def load(path, target=None, shared: dict | None = None) -> Artifact:
    """The artifact at `path`; `shared` (see load_weights) lets modules saved together
    share their tensors."""
    directory = artifact_path(path)
    requested = None if target is None else get_target(target)  # the caller's, not the file's
    program, manifest, example_sizes = load_program(directory, requested)
    with phase("weights"):
        state = load_weights(directory, manifest["weights"],
                             _weights_device(program.kplan.target), shared)
    log.info("loaded %s: %d regions for %s", directory, len(program.plan.regions),
             program.kplan.target)
    return Artifact(program, state, example_sizes, manifest.get("versions", {}))


def load_program(directory: Path, requested: Target | None
                 ) -> tuple[Program, dict, dict[str, int]]:
    """The Program of the artifact in `directory` (its plan, kernels and memory plan, all
    checked; the weights it lists checked against the plan but not read), its manifest
    and its example sizes."""
    with phase("manifest"):
        manifest = read_manifest(directory)
    where = str(directory / MANIFEST_FILE)
    try:
        tgt = _target(manifest["target"], requested)
        _check_versions(manifest, {**manifest["kernels"],
                                   **(manifest.get("narrow") or {}).get("kernels", {})})
        binaries: dict = {}
        program = _program(manifest, tgt, directory, binaries, manifest, where)
        if not program.plan.dim_names:  # manifests before the plan carried them
            program.plan.dim_names = {str(sym): str(name)
                                      for name, sym in manifest.get("dim_names", {}).items()}
        if "narrow" in manifest:
            program.narrow = _narrow(manifest["narrow"], program, tgt, directory, binaries,
                                     manifest, where)
        example_sizes = {k: int(v) for k, v in manifest.get("example_sizes", {}).items()}
    except (ManifestFormatError, KeyError, TypeError, ValueError, AttributeError) as e:
        detail = f"missing entry {e}" if isinstance(e, KeyError) else str(e)
        raise ArtifactError(f"{where} is not a valid kiln manifest: {detail}",
                            hint=_RECOMPILE) from None
    return program, manifest, example_sizes


def _program(entries: dict, tgt: Target, directory: Path, binaries: dict, manifest: dict,
             where: str) -> Program:
    """The Program of a manifest's plan, memory plan and kernels (`entries`: the
    manifest itself, or its narrow version's entry), checked."""
    with phase("plan"):
        plan = plan_from_json(entries["plan"])
        _check_ops_registered(plan, where)
        problems = verify_plan(plan)
    if problems:
        raise ManifestFormatError("the plan does not verify: " + problems[0])
    kernel_entries = entries["kernels"]
    missing = [r.name for r in plan.regions if r.name not in kernel_entries]
    if missing:
        raise ManifestFormatError(f"regions {missing} have no kernel")
    with phase("kernels"):
        kernels = {r.name: _kernel(kernel_entries[r.name], r, tgt, directory, binaries, plan)
                   for r in plan.regions}
    with phase("memory_plan"):
        mem = _memory_plan(plan, entries["memory"]["slots"])
    _check_state(plan, manifest["weights"]["tensors"], directory)
    with phase("program"):
        return Program(KernelPlan(plan, tgt, kernels), mem)


def _narrow(entry: dict, program: Program, tgt: Target, directory: Path, binaries: dict,
            manifest: dict, where: str) -> NarrowVersion:
    """The narrow version kept beside the plan (runtime/program.py): its dim must be one
    of the plan's, its largest size within that dim's bounds."""
    if not isinstance(entry, dict):
        raise ManifestFormatError(f"the narrow version is not an object: {entry!r:.60}")
    symbol, hi = entry.get("symbol"), entry.get("max")
    bounds = program.plan.symbols.get(symbol) if isinstance(symbol, str) else None
    if bounds is None:
        raise ManifestFormatError(f"the narrow version is for {symbol!r}, which is not one "
                                  f"of the plan's dims "
                                  f"({', '.join(sorted(program.plan.symbols)) or 'none'})")
    if not isinstance(hi, int) or isinstance(hi, bool) or not bounds.contains(hi):
        raise ManifestFormatError(f"the narrow version runs {symbol} up to {hi!r}, not a "
                                  f"size within its bounds {bounds}")
    narrow = _program(entry, tgt, directory, binaries, manifest, where)
    narrow.plan.dim_names = narrow.plan.dim_names or dict(program.plan.dim_names)
    return NarrowVersion(symbol, hi, narrow)
