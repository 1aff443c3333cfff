"""CI slice of the fuzzer: 300 fixed-seed random graphs on `cpu` (every 10th also on
`interpret`, every 5th through save/load), and no failure class outside
known_failures.KNOWN. It runs in CI (about 95 s on 2 quiet cores). A new class fails
the test with its seed, which
`python -m tests.fuzz.run --seed SEED --count 1 --minimise DIR` turns into a repro."""

from __future__ import annotations

import os
import time

from tests.fuzz.run import Plan, fuzz, report, summarise, unknown_failures

SEEDS = range(0, 300)
SLICE = Plan(targets=("cpu", "interpret"), interpret_every=10, save_load_every=5)


def test_fuzz_slice_finds_no_new_failure_class(tmp_path):
    start = time.monotonic()
    jobs = max(1, min(2, os.cpu_count() or 1))
    results = fuzz(list(SEEDS), SLICE, jobs=jobs, cache_dir=str(tmp_path / "cache"))
    counts, classes = summarise(results)
    text = report(results, classes, counts, time.monotonic() - start)
    print(text)
    assert len(results) == len(SEEDS)
    assert counts["ok"] >= len(SEEDS) // 2, text  # the generator makes mostly valid graphs
    new = unknown_failures(classes)
    assert not new, "new failure classes (add a fix, or an entry in known_failures.py):\n" \
        + "\n".join(f"  seed {classes[s]['seed']}: {s}\n    {classes[s]['detail'][:500]}"
                    for s in new)
