"""Screening candidates before timing them in full: a loser by a wide margin stops early.

Why: a Llama-3-8B generation compile timed 412 candidates at ~95 ms each (do_bench's
100 ms of runs: 38.9 s on an H100; ~500 and 64.7 s on an H200 later), and most
candidates of a kernel lose to its best by far more than timing noise. So every
candidate first runs for a short screen (timing.SCREEN_REP_MS); one slower than
PRUNE_RATIO x the fastest screened keeps its screen time, and the others run on to a
contender's budget (timing.SCREENED_REP_MS), their median taken over the screen's
samples and the rest's together: the winner is the one an unscreened timing of the
contenders would pick, unless a screen misjudged a candidate by more than PRUNE_RATIO.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from statistics import median

from kiln.codegen.autotune.timing import (
    PRUNE_RATIO,
    SCREEN_REP_MS,
    SCREEN_WARMUP_MS,
    SCREENED_REP_MS,
)

SCREEN = (SCREEN_WARMUP_MS, SCREEN_REP_MS)
REST = (SCREEN_WARMUP_MS, SCREENED_REP_MS - SCREEN_REP_MS)

# measure(candidate, (warmup ms, rep ms)) -> (median ms, each run's ms or None)
Measure = Callable[[Hashable, tuple[float, float]], tuple[float, list[float] | None]]


def screened_times(measure: Measure, candidates: list) -> tuple[dict, set]:
    """({candidate: ms}, the candidates whose ms is their screen's alone): every
    candidate screened, those within PRUNE_RATIO of the fastest screen timed on."""
    first = {c: measure(c, SCREEN) for c in candidates}
    best = min((ms for ms, _ in first.values()), default=math.inf)
    times, pruned = {}, set()
    for c, (ms, samples) in first.items():
        if math.isinf(ms) or ms > PRUNE_RATIO * best:
            times[c] = ms  # did not run, or cannot win
            if not math.isinf(ms):
                pruned.add(c)
            continue
        rest_ms, rest = measure(c, REST)
        if math.isinf(rest_ms) or samples is None or rest is None:
            times[c] = rest_ms  # a runner that reports medians only: the longer one's
        else:
            times[c] = median(samples + rest)
    return times, pruned
