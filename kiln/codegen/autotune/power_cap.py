"""A long prompt's finalists timed at the power cap: each runs back to back first.

Why: a long prefill keeps the GPU at its power cap, and there a kernel's speed is its
work per joule, not its speed at boost clocks. kiln bench's 8B prefill 2048 on an H200
(eighteenth session) held the card at ~690 W with the SM clock at ~1450 MHz (throttle
reason: SW power cap), where the tuner had timed each candidate for tens of ms between
idle gaps at ~1980 MHz. There kiln's 128 x 256 tile had timed level with cuBLAS (w13:
0.706 vs 0.700 ms; the LM head 3.15 vs 3.39, timed right after the tiles had heated
the card); run back to back for a second each (benchmarks/probes/sustained_gemm.py)
the same tile ran 520-545 TFLOP/s against cuBLAS's 630-650 on all five of the 8B's
products, and in the model kiln's tiles took 48.1 ms of the call where torch.compile's
cuBLAS took 43.5.

So at TOP_SIZE (timing.top_env) the finalists and the torch form are each timed after
SUSTAIN_MS of their own back-to-back runs (do_bench's warm-up: no L2 clear between
them), at the clock the card settles at under that kernel's load, as a long prompt
runs it; every finalist is timed in full (they are within FINALIST_RATIO already, so
there is no screen). The 512- and 128-row timings are left as they were: short prompts
run in bursts, at boost clocks. A region whose fastest form takes under MIN_MS at 512
rows is timed at 2048 the screened way too: its runs are too short to heat the card
alone (in a prefill its clock is set by the large products around it, which scales its
candidates alike), and do_bench's warm-up, counted in runs from the kernel's GPU time,
would spend seconds of host time on 300 ms of a few-microsecond kernel.
"""

from __future__ import annotations

from kiln.codegen.autotune.screen import Measure
from kiln.codegen.autotune.timing import REP_MS

SUSTAIN_MS = 300
SUSTAINED = (SUSTAIN_MS, REP_MS)  # a timing's (warm-up ms, rep ms)
MIN_MS = 0.02  # the fastest form's ms at 512 rows below which the top is not sustained


def worth_sustaining(times: dict) -> bool:
    """Whether a region whose forms took `times` (ms at 512 rows) is timed sustained at
    the top: its fastest form is long enough to run GPU-bound back to back."""
    finite = [t for t in times.values() if t != float("inf")]
    return bool(finite) and min(finite) >= MIN_MS


def sustained_times(measure: Measure, candidates: list) -> tuple[dict, set]:
    """({candidate: ms}, no screened-only ones): each timed after SUSTAIN_MS of its own
    back-to-back runs."""
    return {c: measure(c, SUSTAINED)[0] for c in candidates}, set()


def describe() -> str:
    """The note saying how the finalists were timed."""
    return f"sustained: each after {SUSTAIN_MS} ms back to back"


def key() -> str:
    """What the choice cache key adds for a region timed at the top."""
    return f"sustained {SUSTAIN_MS}>={MIN_MS}"
