"""The choice cache: each tuned kernel's winner and its binary, in KILN_CACHE_DIR.

Why: tuning costs compiles (seconds each) and timings; a second compile of the same
model must tune nothing. A choice is keyed by what decides it: the kernel's source
hash, the candidate configs, the target, the Triton version, the tune mode, how the
choice was made ("untimed", or the example's sizes rounded up to powers of two when
timed on a GPU) and the compile function. The entry holds the winning config and its
binary (or "extern" when torch won or nothing compiled), so a hit needs no worker; a
decode batch whose two ends each keep their own winner (both_ends.py) holds both, and
the largest sizes the low end's runs.

Each entry is a directory written under a temporary name and renamed into place, so
a reader never sees half an entry and concurrent compiles cannot corrupt one. An entry
that cannot be read (truncated, garbage, from another version) is a miss; a cache
directory that cannot be written is logged once and tuning goes on uncached.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton

from kiln.codegen.autotune.quarantine import target_id, unwritable
from kiln.codegen.build import grid_dependency
from kiln.codegen.build.compiler import Binary
from kiln.codegen.build.spec import Config, KernelSpec
from kiln.settings import cache_dir
from kiln.target import Target


@dataclass
class Choice:
    kind: str  # "triton", "extern", or "switch" (low and high below)
    config: Config | None = None
    binary: Binary | None = None
    ms: float | None = None  # the winner's median time when timed
    note: str = ""  # how it was chosen, for the region's notes
    final: bool = True  # False: made without the timing it should have had; not cached
    # "switch": the low end's choice runs where every dim of low_sizes is at most its
    # size there, the top's (high) elsewhere
    low: Choice | None = None
    high: Choice | None = None
    low_sizes: dict[str, int] | None = None


def choice_key(spec: KernelSpec, configs: list[Config], target: Target, mode: str,
               sizes: str, compile_fn: str) -> str:
    parts = [spec.source_hash, [str(c) for c in configs], target_id(target),
             triton.__version__, mode, sizes, compile_fn]
    if grid_dependency.applies(target):  # binaries launched as programmatic dependents
        parts.append("pdl")
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


# entry file (path, mtime, size) -> the Choice read from it: regions that run one kernel
# (a model's layers) share one Binary, read once and loaded onto the GPU once
_READ: dict[tuple, Choice] = {}


class ChoiceCache:
    def __init__(self, root: Path | None = None):
        self.root = root or cache_dir() / "autotune" / "choices"

    def get(self, key: str) -> Choice | None:
        path = self.root / key / "choice.json"
        try:
            st = path.stat()
        except OSError:
            return None
        stamp = (str(path), st.st_mtime_ns, st.st_size)
        if stamp not in _READ:
            choice = self._read(key)
            if choice is None:
                return None
            _READ[stamp] = choice
        return _READ[stamp]

    def _read(self, key: str) -> Choice | None:
        entry = self.root / key
        try:
            return _from_json(json.loads((entry / "choice.json").read_text()), entry)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # unreadable: tune again (put replaces it)

    def put(self, key: str, choice: Choice, kernel: str = "") -> None:
        """Store `choice`; `kernel` (the spec's name) is written for people reading the
        cache (which configs win, per kernel family), never read back."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=self.root))
        except OSError as e:
            unwritable(self.root, e)
            return
        try:
            d = {"kernel_name": kernel, **_to_json(choice, tmp, "kernel")}
            (tmp / "choice.json").write_text(json.dumps(d, indent=1))
            final = self.root / key
            if final.exists():  # a newer decision replaces the old one
                shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except OSError:  # another compile stored the same key first: theirs stands
            shutil.rmtree(tmp, ignore_errors=True)

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _to_json(choice: Choice, entry: Path, stem: str) -> dict:
    """`choice` as JSON, its binaries written into `entry` (a switch's as STEM-low/-high)."""
    d = {"kind": choice.kind, "ms": choice.ms, "note": choice.note,
         "config": choice.config.to_json() if choice.config else None,
         "binary": choice.binary.save(entry, stem) if choice.binary else None}
    if choice.kind == "switch":
        d["low_sizes"] = dict(choice.low_sizes)
        d["low"] = _to_json(choice.low, entry, f"{stem}-low")
        d["high"] = _to_json(choice.high, entry, f"{stem}-high")
    return d


def _from_json(d: dict, entry: Path, nested: bool = False) -> Choice | None:
    """The Choice `d` describes, or None when it is not one this kiln makes."""
    kind = d["kind"]
    if kind == "switch" and not nested:  # one level: the tuner never nests switches
        low, high = _from_json(d["low"], entry, True), _from_json(d["high"], entry, True)
        sizes = {str(k): int(v) for k, v in d["low_sizes"].items()}
        if low is None or high is None or not sizes:
            return None
        return Choice("switch", ms=d.get("ms"), note=d.get("note", ""), low=low, high=high,
                      low_sizes=sizes)
    binary = Binary.load(entry, d["binary"]) if d.get("binary") else None
    config = Config.from_json(d["config"]) if d.get("config") else None
    if kind not in ("triton", "extern") or (kind == "triton" and config is None):
        return None
    return Choice(kind, config, binary, d.get("ms"), d.get("note", ""))
