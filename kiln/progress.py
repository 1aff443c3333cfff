"""Progress bars for long steps (export, tuning, loading weights), and the time each
phase of a compile took.

Bars are shown on an interactive terminal, or when KILN_PROGRESS=1; silent in CI, in
pipes and when KILN_PROGRESS=0, so logs stay clean.

Phases: kiln.compile records where its time went (`recording(into)` around the
compile, `phase(name)` around each part); the pass manager times every pass and its
verification, and a pass times its own parts inside (torch.export and the
decompositions in the import pass, templates / kernel builds / tuning in codegen).
A phase inside another is keyed by both names, "import/export/decompose", and its
time is also part of its parent's. Outside a recording `phase` costs one lookup.
The times are a CompiledModule's `compile_timings` (`kiln explain --timings`).
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar

from tqdm.auto import tqdm

from kiln.settings import progress_enabled

# (the dict phases are added to, the key of the phase running now)
_recording: ContextVar[tuple[dict[str, float], str] | None] = ContextVar(
    "kiln_phase_recording", default=None)


def enabled() -> bool:
    return progress_enabled()


def progress(total=None, desc: str = "", unit: str = "it", **kw) -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled(), leave=False, **kw)


@contextlib.contextmanager
def recording(into: dict[str, float]):
    """Add the seconds of every `phase` run inside to `into`, by key; inside a phase
    already recording into `into`, under that phase's key (a second run of the passes
    inside phase("narrow") is timed as narrow/...)."""
    now = _recording.get()
    token = _recording.set((into, now[1] if now is not None and now[0] is into else ""))
    try:
        yield into
    finally:
        _recording.reset(token)


@contextlib.contextmanager
def phase(name: str):
    """Time what runs inside as phase `name` (within the phase running now, if any);
    a phase entered again adds to its time."""
    rec = _recording.get()
    if rec is None:
        yield
        return
    into, parent = rec
    key = f"{parent}/{name}" if parent else name
    token = _recording.set((into, key))
    t0 = time.perf_counter()
    try:
        yield
    finally:
        into[key] = into.get(key, 0.0) + time.perf_counter() - t0
        _recording.reset(token)


def top_level(timings: dict[str, float]) -> dict[str, float]:
    """The phases not inside another (their times add up to the whole)."""
    return {k: v for k, v in timings.items()
            if not any(k.startswith(p + "/") for p in timings if p != k)}
