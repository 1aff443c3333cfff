"""The compile cache: a compiled module kept in KILN_CACHE_DIR under what made it, so a
second compile of the same model skips decomposition, every pass and kernel selection.

Why: of a Llama-3-8B compile for generation (prefill + decode, ~780 regions), export
is a quarter; decomposing the captured program and kiln's passes are most of the rest
(issue 10: a warm compile within 15 s). A cache keyed by the model's source code would
skip export too, but what a program is made of cannot be read from source: functions
patched at run time, environment variables, imports inside functions, a config
computed on the fly. So the key is taken after torch.export, from the captured program
itself (frontend/fingerprint.py), plus everything else the compile reads: the target,
options and tuning mode (from the environment too), Triton's TRITON_* settings, whether
a GPU of the target is here to time candidates on, the example arguments' shapes and
dtypes, the dynamic dims' names and bounds, and the versions of Python, torch, Triton,
sympy and kiln (kiln by a digest of its own source files, so an edited kiln never reads
an older kiln's entry).

An entry is an artifact without weights (manifest.json: plan, memory plan, kernels,
their binaries in kernels/): the program reads the model's parameters and buffers by
name, bound again from the newly captured program at every hit. Tensors the
decomposition made (not in the captured program) are stored with it; they come from
the program alone. A tensor a pass derived from one model tensor by a recorded recipe
(ir/derived.py: Meta's complex RoPE table as real pairs) is kept as that recipe, checked
at put to remake what the plan was compiled with, and made again from the model's
current tensor at every hit: a buffer's values are not in the key, so another model of
the same program gets its own. A compile is not kept when its plan reads any other
tensor kiln computed from weight values (constant folding: fold_constants), when it
warned (a fallback, a kernel left to torch), or when it is one rank of a multi-device
plan. Entries are written under a temporary name and renamed into place; an entry that
cannot be read is a miss, never an error, and a cache that cannot be written only logs.
`options={"compile_cache": False}` or KILN_COMPILE_CACHE=0 turns it off.

A model built only from kiln's and torch.nn's modules has a second key, made the same
way from its module tree (frontend/module_identity.py) instead of its program: kiln's
source digest and torch's version are in every key, so for such a model the tree decides
the program. That key holds only an alias to the entry its compile wrote; a compile
looks it up before export, so a warm compile of kiln.models' LLMs skips export too.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import sympy
import torch
import torch.utils._pytree as pytree
import triton

from kiln.artifact.load import load_program
from kiln.artifact.manifest import encode_dtype
from kiln.artifact.save import MANIFEST_FILE, build_manifest, dumps
from kiln.artifact.weights import load_weights, save_weights
from kiln.codegen.autotune.timing import gpu_for
from kiln.errors import KilnError
from kiln.frontend.fingerprint import program_fingerprint, value_digest
from kiln.ir.derived import Derivation
from kiln.progress import phase
from kiln.runtime.program import Program
from kiln.settings import (
    cache_dir,
    compile_cache_enabled,
    fp8_gemm_tma,
    fp8_gemv_packed,
    pdl_enabled,
    tune_mode,
    tune_timing,
)
from kiln.target import Target
from kiln.version import __version__

log = logging.getLogger("kiln.artifact")

KILN_ROOT = Path(__file__).resolve().parents[1]
FORMAT = 1  # of an entry; a new layout gets new keys
ALIAS_FILE = "alias"  # an identity key's directory: the name of the entry it stands for


@functools.cache
def kiln_source_digest() -> str:
    """A digest of kiln's own source files: an edited kiln makes new keys."""
    h = hashlib.sha256()
    for path in sorted(KILN_ROOT.rglob("*.py")):
        h.update(str(path.relative_to(KILN_ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def compile_key(ep: torch.export.ExportedProgram, target: Target, options: dict,
                examples: list, dynamic_shapes) -> str:
    """What decides a compile: the captured program and everything else it reads."""
    return _key(program_fingerprint(ep), target, options, examples, dynamic_shapes)


def identity_key(identity: str, target: Target, options: dict, examples: list,
                 dynamic_shapes) -> str:
    """The key of a compile whose model has a module identity (frontend/module_identity.py):
    found without export, through the alias a compile keyed after export left."""
    return _key(f"module:{identity}", target, options, examples, dynamic_shapes)


def _key(program: str, target: Target, options: dict, examples: list,
         dynamic_shapes) -> str:
    user = {k: v for k, v in options.items()
            if k not in ("example_leaves", "parallel", "state", "imported_state")}
    parts = {
        "format": FORMAT,
        "program": program,
        "target": repr(target),
        "options": repr(sorted(user.items(), key=lambda kv: kv[0])),
        "tuning": [tune_mode(), tune_timing(), gpu_for(target), pdl_enabled(),
                   fp8_gemv_packed(), fp8_gemm_tma()],
        # what Triton emits depends on its own settings
        "triton_env": sorted((k, v) for k, v in os.environ.items() if k.startswith("TRITON_")),
        "examples": [_leaf(x) for x in examples],
        "dims": repr(pytree.tree_map(_dim, dynamic_shapes)),
        "versions": [sys.version, torch.__version__, triton.__version__,
                     sympy.__version__, __version__, kiln_source_digest()],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _leaf(x):
    if isinstance(x, torch.Tensor):
        return [list(x.shape), list(x.stride()), str(x.dtype), str(x.device)]
    return repr(x)


def _dim(d):
    """A torch.export.Dim as its name and bounds (its repr may change between versions)."""
    if hasattr(d, "__name__") and hasattr(d, "min") and hasattr(d, "max"):
        return f"Dim({d.__name__}, {d.min}, {d.max})"
    return d


def usable(options: dict, parallel, compile_to, dump_ir) -> bool:
    """Whether this compile may use the cache at all."""
    if options.get("compile_cache") is False or not compile_cache_enabled():
        return False
    if compile_to is not None or dump_ir is not None:  # an IR wanted, or every pass's dump
        return False
    # planted compilers and runners are tests' own code: their behaviour is not in a key
    return parallel.is_single and not options.get("tune_compiler")


def _root() -> Path:
    return cache_dir() / "compiled"


def get(key: str, state: dict[str, torch.Tensor], target: Target
        ) -> tuple[Program, dict[str, torch.Tensor], dict[str, int]] | None:
    """(program, its state, example sizes) kept under `key`, the state bound from
    `state` (the captured program's parameters, buffers and constants); None on a miss."""
    entry = _root() / key
    if (entry / ALIAS_FILE).is_file():  # an identity key: the entry its compile wrote
        try:
            entry = _root() / (entry / ALIAS_FILE).read_text().strip()
        except OSError:
            return None
    if not (entry / MANIFEST_FILE).is_file():
        return None
    try:
        with phase("compile_cache"):
            program, manifest, example_sizes = load_program(entry, target)
            changed = _values_changed(manifest.get("values_read", {}), state)
            if changed:
                log.info("compile cache %s: the plan was decided by the values of %s, "
                         "which differ here; compiling", key, changed)
                return None
            stored = manifest["stored"]
            bound = dict(load_weights(entry, stored, "cpu")) if stored["tensors"] else {}
            derived = _replay(manifest.get("derived", {}), state)
            if derived is None:
                log.info("compile cache %s: a derived tensor cannot be made from the "
                         "model's tensors; compiling", key)
                return None
            bound.update(derived)
            for name, want in manifest["weights"]["tensors"].items():
                t = bound.get(name, state.get(name))
                if t is None or list(t.shape) != want["shape"] or \
                        encode_dtype(t.dtype) != want["dtype"]:
                    log.info("compile cache %s: %s does not match; compiling", key, name)
                    return None
                bound[name] = t
    except (KilnError, OSError, KeyError, TypeError, ValueError) as e:
        log.info("compile cache entry %s unreadable (%s); compiling", key, e)
        return None
    log.info("compile cache hit %s: %d regions", key, len(program.plan.regions))
    return program, bound, example_sizes


def put(key: str, program: Program, example_sizes: dict, captured: dict, ctx_options: dict,
        warned: bool) -> None:
    """Keep `program` under `key`, if every tensor it reads comes from the captured
    program (`captured`) or from the decomposition; `ctx_options` holds the state as
    imported and after the passes."""
    reason = _not_cacheable(program, captured, ctx_options, warned)
    if reason:
        log.info("compile not cached: %s", reason)
        return
    root = _root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    except OSError as e:
        log.warning("compile cache %s cannot be written (%s)", root, e)
        return
    try:
        with phase("compile_cache"):
            state = ctx_options["state"]
            targets = {v.target for p in program.versions()
                       for v in p.plan.values.values() if v.target}
            derived = ctx_options.get("derived", {})
            made = {n: state[n] for n in sorted(targets)
                    if n not in captured and n not in derived}
            manifest = build_manifest(_Saved(program, example_sizes), tmp)
            manifest["weights"] = {"tensors": {n: {"shape": list(state[n].shape),
                                                   "dtype": encode_dtype(state[n].dtype)}
                                               for n in sorted(targets)}}
            manifest["stored"] = save_weights(made, tmp) if made else {"tensors": {}}
            # recipes, not values: replayed on the model's tensors at every hit
            manifest["derived"] = {n: derived[n].encode() for n in sorted(targets)
                                   if n in derived}
            # tensors whose values decided a rewrite (a mask proved causal): checked at a hit
            imported = ctx_options.get("imported_state", {})
            manifest["values_read"] = {n: value_digest(imported.get(n, state.get(n)))
                                       for n in sorted(ctx_options.get("values_read", ()))}
            (tmp / MANIFEST_FILE).write_text(dumps(manifest) + "\n")
            final = root / key
            if final.exists():
                shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
    except Exception as e:  # noqa: BLE001 - keeping a compile must never fail one
        log.info("compile not cached: %s: %s", type(e).__name__, e)
        shutil.rmtree(tmp, ignore_errors=True)


def alias(identity_key: str, key: str) -> None:
    """Let `identity_key` find the entry kept under `key` (if it was kept)."""
    root = _root()
    if not (root / key / MANIFEST_FILE).is_file():
        return
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{identity_key}.", dir=root))
        (tmp / ALIAS_FILE).write_text(key + "\n")
        final = root / identity_key
        if final.exists():
            shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except OSError as e:
        log.info("compile cache alias %s not written (%s)", identity_key, e)


def _not_cacheable(program: Program, captured: dict, options: dict, warned: bool) -> str:
    if warned or options.get("fallback_ops"):
        return "the compile warned"
    imported = options.get("imported_state", {})
    for name in options.get("values_read", ()):
        t = imported.get(name)
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return f"the plan was decided by {name}'s values, which cannot be kept"
    imported, state = options.get("imported_state", {}), options.get("state", {})
    derived = options.get("derived", {})
    for v in (v for p in program.versions() for v in p.plan.values.values()):
        if v.target is None:
            continue
        if v.target in derived:
            reason = _not_replayable(v.target, derived[v.target], captured, imported, state)
            if reason:
                return reason
            continue
        if v.target not in imported or state.get(v.target) is not imported[v.target]:
            return f"{v.target} was computed by the compile (from weight values)"
        if v.target in captured and captured[v.target] is not state[v.target]:
            return f"{v.target} is not the captured program's tensor"
    return ""


def _values_changed(kept, state: dict[str, torch.Tensor]) -> str | None:
    """The first tensor whose values decided the kept plan and differ in `state` (or are
    missing); None when all match."""
    if not isinstance(kept, dict):
        return "an unreadable entry"
    for name, digest in sorted(kept.items()):
        t = state.get(name)
        if not isinstance(t, torch.Tensor) or digest is None or value_digest(t) != digest:
            return name
    return None


def _not_replayable(name: str, derivation: Derivation, captured: dict, imported: dict,
                    state: dict) -> str:
    """Why `derivation`, replayed at a hit on the captured program's tensor, might not
    give the values `name` was compiled with ("" when it does)."""
    src = derivation.source
    if src not in captured or captured[src] is not imported.get(src) \
            or state.get(src) is not captured[src]:
        return f"{name} was derived from {src}, which is not the captured program's tensor"
    again = derivation.apply(captured[src])
    if again.dtype != state[name].dtype or not torch.equal(again, state[name]):
        return f"{name} is not what its recipe {list(derivation.steps)} makes of {src}"
    return ""


def _replay(entries: dict, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """An entry's derived tensors, each made again from the model's current tensor (so
    another table of the same program is never served the kept one's values); None
    when a source is missing or its recipe does not apply to it."""
    if not isinstance(entries, dict):
        return None
    out = {}
    for name, entry in entries.items():
        derivation = Derivation.decode(entry)
        src = state.get(derivation.source)
        if src is None:
            return None
        try:
            out[name] = derivation.apply(src)
        except RuntimeError:  # e.g. view_as_real of a real tensor
            return None
    return out


class _Saved:
    """What build_manifest reads of a CompiledModule."""

    def __init__(self, program: Program, example_sizes: dict):
        self.program, self.example_sizes = program, example_sizes
