"""A decode batch timed at both ends: one kernel for every size, or each end its own.

Why: a dynamic dim bounded <= 64 (timing.low_env) is a decode step's batch, each size
of which is captured as its own CUDA graph, so it is timed at its top and at its low
end. Picking one kernel for both (the best worst-case ratio) won the Llama-3-8B's
decode 13% at 1 row and lost it 12% at 4 (H100: replay 7.83 -> 6.78 ms at b1, 8.14 ->
9.14 ms at b4). So when no candidate is within SWITCH_GAIN of the fastest at both
ends, each end keeps its own winner and a SizeSwitch (kiln/codegen/size_switch.py)
runs the low end's up to the size where the two winners' times cross (switch_point).
"""

from __future__ import annotations

import math

SWITCH_GAIN = 0.03  # a second kernel is kept only if one alone loses more than this


def worst_ratio(*timings: dict) -> dict:
    """Per candidate, the largest of its time / the fastest time, over `timings`
    (math.inf where it did not run at some size)."""
    out = {}
    for c in timings[0]:
        ratios = []
        for t in timings:
            best = min(t.values())
            ratios.append(t[c] / best if best > 0 and not math.isinf(best) else t[c])
        out[c] = max(ratios)
    return out


def one_serves_both(scores: dict) -> bool:
    """Whether some candidate is within SWITCH_GAIN of the fastest at both ends
    (`scores`: worst_ratio's)."""
    return min(scores.values()) <= 1 + SWITCH_GAIN


def switch_point(low_winner: tuple[float, float],
                 top_winner: tuple[float, float]) -> float | None:
    """Where the low end's winner stops being the faster, as a fraction of the way from
    the low end (0) to the top (1); each argument is that winner's (ms at the low end,
    ms at the top). None when one of the two is within SWITCH_GAIN of the other at
    both ends: it alone serves every size.

    Between the ends each time is taken as linear in the size, so the point is where
    the two lines cross: a per-row kernel (a GEMV) grows with the rows, a tiled one
    (cuBLAS) stays nearly flat below its tile, and the crossing falls nearer the end
    whose winner wins by less. A winner that did not run at the other end
    (math.inf) gives that end every size but its own.
    """
    (l0, l1), (t0, t1) = low_winner, top_winner
    if t0 <= l0 * (1 + SWITCH_GAIN) or l1 <= t1 * (1 + SWITCH_GAIN):
        return None
    if math.isinf(l1) or math.isinf(t0):
        if math.isinf(l1) and math.isinf(t0):
            return 0.5
        return 0.0 if math.isinf(l1) else 1.0
    below, above = t0 - l0, l1 - t1  # both positive here
    return below / (below + above)


def low_sizes(low: dict[str, int], top: dict[str, int], at: float) -> dict[str, int]:
    """Per dim that differs between the ends' sizes, the largest size the low end's
    kernel runs: the size `at` of the way from the low end to the top, rounded down,
    at least the low end and below the top."""
    out = {}
    for s, lo in low.items():
        hi = top[s]
        if hi > lo:
            out[s] = min(hi - 1, max(lo, math.floor(lo + at * (hi - lo))))
    return out
