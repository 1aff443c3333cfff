"""Probe: where a cold compile's tuning time goes (issue 10's 60 s cold compile).

The 8B LLM's ~35 distinct kernels are the same at 2 layers as at 32, so a 2-layer
kiln.models LLM (llama3-8b preset, bf16, paged, max batch 4) compiled cold, in this
process, with fresh KILN_CACHE_DIR and TRITON_CACHE_DIR, tunes what the 8B tunes.
Reported: the compile's phases, the run worker's jobs (count, seconds in the worker,
by kind), the compile workers' start-up, and each kernel's choice (to compare variants'
choices). Variants:

    --screen W R / --rest W R   the screen's and the rest's (warmup ms, rep ms)
    --inprocess                 time in this process (KILN_TUNE_TIMING=inprocess)
    --profile                   cProfile the compile: the top functions by cumulative time

GPU: PYTHONPATH=. python benchmarks/probes/tuning_cost.py --out $OUT/tc.json [variant]
"""

import argparse
import collections
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=2)
p.add_argument("--screen", type=float, nargs=2)
p.add_argument("--rest", type=float, nargs=2)
p.add_argument("--inprocess", action="store_true")
p.add_argument("--profile", action="store_true")
p.add_argument("--prestart", action="store_true", help="start every compile worker first")
p.add_argument("--tune", default="fast")
p.add_argument("--target", default="cuda")
p.add_argument("--out", required=True)
args = p.parse_args()

tmp = tempfile.mkdtemp(prefix="kiln-tuning-cost-")
os.environ.update(KILN_CACHE_DIR=f"{tmp}/kiln", TRITON_CACHE_DIR=f"{tmp}/triton",
                  KILN_PROGRESS="0", KILN_TUNE=args.tune)
if args.inprocess:
    os.environ["KILN_TUNE_TIMING"] = "inprocess"

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the run worker finds the runner
from kiln.codegen.autotune import screen, tuner, worker_pool  # noqa: E402

tuner.DEFAULT_RUNNER = "tuning_cost_runner:measure"

if args.screen:
    screen.SCREEN = tuple(args.screen)
if args.rest:
    screen.REST = tuple(args.rest)

# every run-worker job: its kind, seconds in the worker (Outcome.seconds), its parts
jobs: list[tuple[str, float, dict]] = []
_run = worker_pool.WorkerPool.run


# the parent's side of the run worker's jobs: from asking to the answer (in flight,
# Outcome.seconds being the part after a worker took the job) and between one answer
# and the next question (the tuner's own work, or the GIL, in between)
parent = {"asked": 0.0, "between": 0.0, "n": 0}
_last_answer: list[float] = []


def counted_run(self, work, timeout, want_more=lambda: True):
    asked = time.monotonic()
    if self.module == worker_pool.RUN_WORKER and _last_answer:
        parent["between"] += asked - _last_answer[-1]
    for i, out in _run(self, work, timeout, want_more):
        if self.module == worker_pool.RUN_WORKER:
            kind = work[i].what + (" extern" if work[i].task["spec"] is None else "")
            parts = (out.result or {}).get("t", {}) if isinstance(out.result, dict) else {}
            jobs.append((kind, out.seconds, parts))
            now = time.monotonic()
            parent["asked"] += now - asked
            parent["n"] += 1
            _last_answer[:] = [now]
        yield i, out


worker_pool.WorkerPool.run = counted_run

# compile workers' start-up: from process start to ready
starts: list[float] = []
_init = worker_pool._Worker.__init__


def timed_init(self, module=worker_pool.COMPILE_WORKER):
    _init(self, module)
    self.born = time.monotonic()


worker_pool._Worker.__init__ = timed_init
_receive = worker_pool.WorkerPool._receive


def seen_ready(self, w, busy):
    was = w.ready
    yield from _receive(self, w, busy)
    if not was and w.ready:
        starts.append(time.monotonic() - w.born)


worker_pool.WorkerPool._receive = seen_ready

# each kernel's choice: its wall seconds (build + timing + check), and whether it was
# the narrow version's (the passes run again inside phase "narrow")
chosen: list[dict] = []
_choose = tuner.Tuner.choose


def timed_choose(self, region, spec, plan=None):
    from kiln import progress
    rec = progress._recording.get()
    t = time.perf_counter()
    try:
        return _choose(self, region, spec, plan)
    finally:
        chosen.append({"region": region.name, "kernel": spec.name, "template": spec.template,
                       "narrow": bool(rec and "narrow" in rec[1]),
                       "s": round(time.perf_counter() - t, 3)})


tuner.Tuner.choose = timed_choose

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import compile_time  # noqa: E402


class A:
    preset, layers, max_seq_len, target = "llama3-8b", args.layers, 2048, args.target
    dtype, max_batch_size, cache = "bfloat16", 4, "paged"


if args.prestart:  # what the compile would do if it started its pool before export
    pool = worker_pool.get_pool()
    pool._grow(pool.size)
prof = cProfile.Profile() if args.profile else None
t0 = time.perf_counter()
if prof:
    prof.enable()
llm, wall = compile_time.build_llm(A)
if os.environ.get("TUNING_COST_SELFTEST"):  # the report's path, without a GPU
    jobs.append(("time", 0.1, {"buffers": 0.01}))
if prof:
    prof.disable()
total = time.perf_counter() - t0
timings = [llm.prefill_module.compile_timings, llm.decode_module.compile_timings]
phases = compile_time.phases_of(timings)
by_kind = collections.defaultdict(lambda: [0, 0.0, collections.Counter()])
for kind, s, parts in jobs:
    by_kind[kind][0] += 1
    by_kind[kind][1] += s
    by_kind[kind][2].update(parts)
choices = []
for f in sorted(Path(f"{tmp}/kiln/autotune/choices").glob("*/choice.json")):
    d = json.loads(f.read_text())
    choices.append({"kernel": d.get("kernel_name"), "kind": d["kind"], "ms": d.get("ms"),
                    "note": d.get("note", "")})
report = {"variant": vars(args), "compile_s": llm.compile_s, "wall_s": total,
          "phases": phases, "run_jobs": {
              k: {"n": n, "s": round(s, 2), "parts": {p: round(v, 2) for p, v in parts.items()}}
              for k, (n, s, parts) in by_kind.items()},
          "run_jobs_parent": {k: round(v, 2) for k, v in parent.items()},
          "compile_worker_start_s": sorted(round(s, 2) for s in starts),
          "choices": choices, "chosen": chosen}
Path(args.out).write_text(json.dumps(report, indent=1))
print(f"compile {llm.compile_s:.1f} s (wall {total:.1f})")
for k, v in phases.items():
    if v >= 0.3:
        print(f"  {k:<52} {v:7.2f}")
for k, v in report["run_jobs"].items():
    print(f"  run jobs {k:<16} n={v['n']:4d} worker s={v['s']:7.2f} parts {v['parts']}")
print("  run jobs, parent's view (s):", report["run_jobs_parent"])
print("  compile workers ready after (s):", report["compile_worker_start_s"])
groups = collections.defaultdict(lambda: [0, 0.0])
for c in chosen:
    g = groups[(c["template"], "narrow" if c["narrow"] else "plan")]
    g[0] += 1
    g[1] += c["s"]
for (template, which), (n, s) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
    print(f"  choose {template:<12} {which:<7} n={n:4d} {s:7.2f} s")
for c in sorted(chosen, key=lambda c: -c["s"])[:30]:
    print(f"    {c['s']:6.2f} s  {'narrow ' if c['narrow'] else ''}{c['region']}: {c['kernel']}")
if prof:
    st = pstats.Stats(prof)
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(25)
