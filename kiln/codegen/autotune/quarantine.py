"""The quarantine: configs that failed, kept on disk so a known-bad config is not retried.

Why (DESIGN.md failure 5): a config that crashes Triton's compiler will crash it again,
and a config that hangs will hang again; each try costs a worker (seconds to restart)
or a whole timeout. Triton's own autotuner keeps no record, so every run pays again.
kiln records every failure of a (kernel source hash, config, Triton version, target)
and, for the kinds that are facts about that key, never compiles it again:

    crash       the compiler process died (C++ assertion, segfault)   never retried
    hang        the compile passed its deadline and was killed        never retried
    over_limit  needs more than the target has (real figures, or
                Triton's OutOfResources)                              never retried
    wrong       compiled and ran, but its outputs differ from the torch
                form where another config's agree (verify.py)          never retried
                (unless judged by an older check: WRONG_CHECK)
    runtime_fault  compiled, but running it on the GPU faulted (illegal or
                misaligned address, launch failure), crashed or hung
                the run worker (run_worker.py)                          never retried
    error       the compiler raised (CompilationError, PTXASError...)  recorded, retried

Ordinary compile errors are retried on the next tuning because they may come from
the environment (a missing ptxas, a full disk) rather than the config, and retrying
one is cheap (the worker survives). A new Triton version or a changed kernel source
makes a new key, so nothing stays quarantined past the cause. To forget everything,
delete KILN_CACHE_DIR/autotune/failures (or call Quarantine().clear()).

One JSON file per key, written atomically: concurrent compiles share the records.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import triton

from kiln.codegen.build.spec import Config, KernelSpec
from kiln.settings import cache_dir
from kiln.target import Target

log = logging.getLogger("kiln.codegen")

CRASH, HANG, OVER_LIMIT, WRONG, ERROR = "crash", "hang", "over_limit", "wrong", "error"
RUNTIME_FAULT = "runtime_fault"
NEVER_RETRIED = frozenset({CRASH, HANG, OVER_LIMIT, WRONG, RUNTIME_FAULT})
# the output check's version: `wrong` verdicts of an older check are retried. 2: an
# in-place region (a KV-cache write) is checked over a copy of its state; the first
# check gave it an empty output buffer and judged correct kernels wrong
WRONG_CHECK = 2


def _read(path: Path) -> Failure | None:
    """A recorded failure, or None when the file is missing or unreadable (truncated,
    garbage, another version's): an unreadable record blocks nothing."""
    try:
        d = json.loads(path.read_text())
        d["key"] = FailureKey(**d["key"])
        return Failure(**d)
    except (OSError, ValueError, KeyError, TypeError):
        return None


_warned: set[str] = set()


def unwritable(root: Path, error: OSError) -> None:
    """Log once per directory that kiln's cache cannot be written (read-only, full)."""
    if str(root) not in _warned:
        _warned.add(str(root))
        log.warning("kiln cache %s cannot be written (%s): tuning results are not kept; "
                    "set KILN_CACHE_DIR to a writable directory", root, error)


def target_id(target: Target) -> str:
    """The target's name plus a digest of its limits (changed limits: a new key)."""
    return f"{target.name}-{hashlib.sha256(repr(target).encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class FailureKey:
    source_hash: str
    config: str
    triton_version: str
    target: str

    @staticmethod
    def of(spec: KernelSpec, config: Config, target: Target) -> FailureKey:
        return FailureKey(spec.source_hash, str(config), triton.__version__, target_id(target))

    def digest(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:32]


@dataclass
class Failure:
    key: FailureKey
    kind: str  # CRASH, HANG, OVER_LIMIT, WRONG, RUNTIME_FAULT or ERROR
    reason: str
    kernel: str  # the kernel's name, for people reading the records
    compile_fn: str
    when: float
    check: int = 0  # WRONG_CHECK when kind is WRONG (records before it: 0)

    @property
    def never_retried(self) -> bool:
        if self.kind == WRONG:
            return self.check == WRONG_CHECK
        return self.kind in NEVER_RETRIED


class Quarantine:
    def __init__(self, root: Path | None = None):
        self.root = root or cache_dir() / "autotune" / "failures"

    def _path(self, key: FailureKey) -> Path:
        return self.root / f"{key.digest()}.json"

    def get(self, key: FailureKey) -> Failure | None:
        return _read(self._path(key))

    def blocked(self, key: FailureKey) -> Failure | None:
        """The recorded failure that forbids compiling `key` again, if there is one."""
        f = self.get(key)
        return f if f is not None and f.never_retried else None

    def record(self, key: FailureKey, kind: str, reason: str, kernel: str,
               compile_fn: str) -> Failure:
        f = Failure(key, kind, reason, kernel, compile_fn, time.time(),
                    WRONG_CHECK if kind == WRONG else 0)
        path = self._path(key)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(asdict(f), indent=1))
            tmp.replace(path)
        except OSError as e:  # still quarantined for this compile: the caller holds f
            unwritable(self.root, e)
        return f

    def forget(self, key: FailureKey) -> None:
        """Drop a record (an error that a retry cured)."""
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:
            unwritable(self.root, e)

    def all(self) -> list[Failure]:
        paths = sorted(self.root.glob("*.json")) if self.root.exists() else []
        return [f for f in map(_read, paths) if f is not None]

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
