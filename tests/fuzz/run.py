"""kiln's random-graph differential fuzzer: the command line.

    python -m tests.fuzz.run --seed 0 --count 300 --targets cpu,interpret \\
        [--gpu-compile sm_90] [--minimise DIR] [--json out.json] [--jobs 2]
    python -m tests.fuzz.run --targets cpu,cuda ...   # on a GPU: runs its kernels

Graph i is generate(seed + i): the same command finds the same graphs. Every graph
runs on `cpu`; `interpret`, the save/load round trip and compile-only GPU targets run
on a deterministic share of the graphs (their --*-every options), since they cost
more. Prints a summary (graphs, ok, refused, crashes, mismatches, fallbacks) and each
distinct failure class with its count and first seed, marked known or NEW against
tests/fuzz/known_failures.py; exits 1 when there is a NEW one. --minimise DIR writes a
minimised standalone repro of the first graph of every failure class into DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass

FAILURES = ("crash", "mismatch", "fallback")


@dataclass
class Plan:
    """Which checks graph `seed` gets: a pure function of the seed and the options."""

    targets: tuple[str, ...] = ("cpu",)
    interpret_every: int = 4
    save_load_every: int = 5
    gpu: tuple[str, ...] = ()
    gpu_every: int = 1

    def config_for(self, index: int):
        from tests.fuzz.oracle import Config

        targets = tuple(t for t in self.targets
                        if t != "interpret" or index % self.interpret_every == 0)
        gpu = self.gpu if self.gpu and index % self.gpu_every == 0 else ()
        return Config(targets=targets, gpu=gpu, save_load=index % self.save_load_every == 0)


def fuzz_one(seed: int, index: int, plan: Plan) -> dict:
    from tests.fuzz.generate import generate
    from tests.fuzz.oracle import GraphResult, Outcome, check, normalise

    spec = generate(seed)
    start = time.monotonic()
    try:
        result = check(spec, plan.config_for(index))
    except Exception as e:  # noqa: BLE001 - a bug of the fuzzer's own: report, go on
        result = GraphResult(seed, spec.ops(), [Outcome(
            "crash", "fuzzer", "oracle", f"{type(e).__name__}: {e}",
            f"crash|fuzzer|oracle|{type(e).__name__}|{normalise(str(e))}")])
    return {"seed": seed, "ops": result.ops, "seconds": round(time.monotonic() - start, 2),
            "worst": result.worst.cls, "aten": sorted(result.aten),
            "outcomes": [asdict(o) for o in result.outcomes]}


def _init_worker(cache_dir: str, where=None) -> None:
    if where is not None:  # a forked worker: the caller's environment and directory
        from tests import forkserver

        forkserver.enter(where)
    os.environ["KILN_CACHE_DIR"] = cache_dir
    os.environ.setdefault("KILN_PROGRESS", "0")


def fuzz(seeds: list[int], plan: Plan, jobs: int = 1, time_limit: float | None = None,
         cache_dir: str | None = None, on_result=None) -> list[dict]:
    """Run every seed (or as many as `time_limit` seconds allow), in `jobs` processes."""
    cache_dir = cache_dir or os.environ.get("KILN_CACHE_DIR") or "/tmp/kiln-fuzz-cache"
    _init_worker(cache_dir)
    deadline = None if time_limit is None else time.monotonic() + time_limit
    results = []
    if jobs <= 1:
        for i, s in enumerate(seeds):
            if deadline is not None and time.monotonic() > deadline:
                break
            results.append(fuzz_one(s, i, plan))
            if on_result:
                on_result(results[-1])
        return results
    from tests import forkserver

    # workers forked with torch and kiln imported: seconds of imports saved per worker
    with ProcessPoolExecutor(jobs, mp_context=forkserver.context(), initializer=_init_worker,
                             initargs=(cache_dir, forkserver.caller())) as pool:
        pending = {}
        it = iter(enumerate(seeds))
        for _ in range(jobs * 2):
            _submit(pool, it, pending, plan)
        while pending:  # whichever graph ends first: a slow one idles no worker
            for done in wait(pending, return_when=FIRST_COMPLETED).done:
                results.append(done.result())
                del pending[done]
                if on_result:
                    on_result(results[-1])
                if deadline is None or time.monotonic() < deadline:
                    _submit(pool, it, pending, plan)
    results.sort(key=lambda r: r["seed"])
    return results


def _submit(pool, it, pending, plan) -> None:
    nxt = next(it, None)
    if nxt is not None:
        i, s = nxt
        pending[pool.submit(fuzz_one, s, i, plan)] = s


def summarise(results: list[dict]) -> tuple[Counter, dict[str, dict]]:
    """Per-graph worst-class counts, and each failure signature's count and first seed."""
    counts = Counter(r["worst"] for r in results)
    classes: dict[str, dict] = {}
    for r in results:
        for o in r["outcomes"]:
            if o["cls"] == "ok":
                continue
            c = classes.setdefault(o["signature"], {"cls": o["cls"], "count": 0,
                                                    "seed": r["seed"], "detail": o["detail"],
                                                    "target": o["target"]})
            c["count"] += 1
    return counts, classes


def unknown_failures(classes: dict[str, dict]) -> list[str]:
    from tests.fuzz.known_failures import is_known

    return [s for s, c in classes.items() if c["cls"] in FAILURES and not is_known(s)]


def report(results: list[dict], classes: dict[str, dict], counts: Counter,
           seconds: float) -> str:
    from tests.fuzz.known_failures import is_known

    lines = [f"{'graphs':>8} {'ok':>6} {'refused':>8} {'crashes':>8} {'mismatches':>11} "
             f"{'fallbacks':>10} {'seconds':>8}",
             f"{len(results):>8} {counts['ok']:>6} {counts['refused']:>8} "
             f"{counts['crash']:>8} {counts['mismatch']:>11} {counts['fallback']:>10} "
             f"{seconds:>8.1f}"]
    per_target = Counter((o["target"], o["cls"]) for r in results for o in r["outcomes"])
    lines.append("per target: " + ", ".join(f"{t}:{c}={n}" for (t, c), n in
                                             sorted(per_target.items())))
    fails = {s: c for s, c in classes.items() if c["cls"] in FAILURES}
    lines.append(f"{len(fails)} distinct failure classes:")
    for s, c in sorted(fails.items(), key=lambda kv: -kv[1]["count"]):
        tag = "known" if is_known(s) else "NEW"
        lines.append(f"  [{tag}] x{c['count']} seed {c['seed']}: {s}")
    lines.append(coverage(results))
    refusals = {s: c for s, c in classes.items() if c["cls"] == "refused"}
    lines.append(f"{len(refusals)} distinct refusals (clean KilnErrors):")
    for s, c in sorted(refusals.items(), key=lambda kv: -kv[1]["count"])[:15]:
        lines.append(f"  x{c['count']} seed {c['seed']}: {s}")
    return "\n".join(lines)


def coverage(results: list[dict]) -> str:
    """Which ops of kiln's table (kiln.ir.ops) the compiled plans ran: when kiln learns an
    op, it shows up here as never exercised until the catalogue (ops.py) grows too."""
    from kiln.ir.ops import _TABLE

    seen = {a for r in results for a in r.get("aten", ())}
    never = sorted(n for n in _TABLE if n not in seen)
    return (f"coverage: {len(set(_TABLE) & seen)} of {len(_TABLE)} ops in kiln's table ran "
            f"in a compiled plan; never: {', '.join(n[5:] for n in never)}")


def minimise_all(classes: dict[str, dict], plan: Plan, directory: str,
                 budget: int = 60) -> dict[str, str]:
    """A minimised repro for the first seed of every failure class: signature -> path."""
    from tests.fuzz.generate import generate
    from tests.fuzz.minimise import failure_key, minimise, write_repro
    from tests.fuzz.oracle import Config, check, on_device

    out = {}
    for sig, c in classes.items():
        if c["cls"] not in FAILURES:
            continue
        target = c["target"]
        gpu = target.startswith(("cuda", "rocm"))
        compile_only = gpu and not on_device(target)
        cfg = Config(targets=() if compile_only else (target,),
                     gpu=(target,) if compile_only else (),
                     save_load="load" in sig.split("|")[2])
        key = failure_key(sig)

        def fails(spec, cfg=cfg, key=key):
            return any(o.cls != "ok" and failure_key(o.signature) == key
                       for o in check(spec, cfg).outcomes)

        small = minimise(generate(c["seed"]), fails, budget)
        final = [o for o in check(small, cfg).outcomes if o.cls != "ok"]
        detail = final[0].detail if final else c["detail"]
        new_sig = final[0].signature if final else sig
        path = write_repro(small, directory, new_sig, detail, target,
                           {"tune": "none"} if gpu else None)
        out[sig] = {"repro": str(path), "minimised_signature": new_sig,
                    "nodes": len(small.nodes)}
        print(f"minimised seed {c['seed']} to {len(small.nodes)} ops: {path}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--targets", default="cpu,interpret",
                    help="cpu, interpret, and on a GPU machine cuda (generated kernels "
                         "forced, outputs compared with eager on the CPU)")
    ap.add_argument("--interpret-every", type=int, default=4,
                    help="run the interpret target on every n-th graph")
    ap.add_argument("--save-load-every", type=int, default=5)
    ap.add_argument("--gpu-compile", default="",
                    help="compile-only GPU archs, e.g. sm_90,sm_80 (or full targets)")
    ap.add_argument("--gpu-every", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=None,
                    help="stop starting graphs after this many seconds (long mode)")
    ap.add_argument("--minimise", metavar="DIR", default=None)
    ap.add_argument("--minimise-budget", type=int, default=60)
    ap.add_argument("--json", default=None)
    ap.add_argument("--progress", action="store_true")
    a = ap.parse_args(argv)
    gpu = tuple(g if ":" in g else f"cuda:{g}" for g in a.gpu_compile.split(",") if g)
    plan = Plan(tuple(t for t in a.targets.split(",") if t), a.interpret_every,
                a.save_load_every, gpu, a.gpu_every)
    start = time.monotonic()

    def tick(r):
        if a.progress:
            print(f"seed {r['seed']}: {r['worst']} ({r['seconds']}s)", flush=True)

    results = fuzz(list(range(a.seed, a.seed + a.count)), plan, a.jobs, a.time_limit,
                   on_result=tick)
    seconds = time.monotonic() - start
    counts, classes = summarise(results)
    print(report(results, classes, counts, seconds))
    repros = minimise_all(classes, plan, a.minimise, a.minimise_budget) if a.minimise else {}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"seconds": seconds, "counts": counts, "classes": classes,
                       "repros": repros, "results": results}, f, indent=1, default=str)
    return 1 if unknown_failures(classes) else 0


if __name__ == "__main__":
    # run as tests.fuzz.run, not __main__: a forked worker unpickles its Plan and
    # fuzz_one by that name
    from tests.fuzz import run

    sys.exit(run.main())
