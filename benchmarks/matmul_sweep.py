"""Kernel-level sweep of kiln's matmul / GEMV / attention templates on Llama-3-8B shapes:
the templates before the Hopper work (the baseline), the current ones at several
configs, and torch (cuBLAS / SDPA), in fp16 and bf16, on one GPU, in one call.

    python benchmarks/matmul_sweep.py --out sweep.json [--dtypes float16,bfloat16]
                                      [--only q_proj,down] [--budget 220]

Each case is one region of a one-op module (matmul_attention.py's cases: prefill of
512 tokens, decode of one, attention over a 2048-long cache). Kernels are launched
directly (no kiln runtime around them), each timed by triton.testing.do_bench (median,
L2 flushed before every run: decode weights are read cold, as in a real model) on the
same random inputs, and checked against torch on them (rel err). Columns:

    torch   the region's torch form (what kiln's tuner times as the extern candidate)
    old     the baseline: the specs the templates generated before the Hopper work
            (the commit is in the file), each at its default config (what kiln ran for
            these static shapes then), read from benchmarks/matmul_sweep_baseline.json
    new     the best of the current spec's candidates (the tuner's "fast" set plus the
            model's next best); `dflt` is the current default config alone

A failing compile, launch or check prints an error row and the sweep goes on. Compiles
run in parallel in kiln's isolated compile workers. The detail lines (every config) come
first, the summary table last; --out gets everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matmul_attention  # noqa: E402  (the cases)

BASELINE = Path(__file__).resolve().parent / "matmul_sweep_baseline.json"
EXTRA_CONFIGS = 2  # configs timed beyond the tuner's fast set, in the model's order
MEASURE_RESERVE_S = 45.0  # of the budget, kept for measuring


def cases(prefill: int, cache: int, batch: int):
    return matmul_attention.cases(prefill, cache, batch)


def key(case, dtype: torch.dtype) -> str:
    return f"{case[0]}/{case[1]}/{str(dtype).replace('torch.', '')}"


def plan_for(case, dtype: torch.dtype, target: str = "cuda:sm_90"):
    import kiln

    torch.manual_seed(0)
    module = case[2].to(dtype).eval()
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in case[3]())
    return kiln.compile(module, args, target=target, compile_to="dispatch")


def main_region(plan):
    from kiln.ir.plan import RegionKind

    (region,) = [r for r in plan.regions if r.kind in (RegionKind.MATMUL,
                                                        RegionKind.ATTENTION)]
    return region


def describe(spec, config, grid=None) -> str:
    c = config.as_dict()
    if spec.template == "attention":
        s = f"{c['BLOCK_M']}x{c['BLOCK_N']} w{config.num_warps} s{config.num_stages}"
        s += f" kv{c['KV_SPLIT']}" if "KV_SPLIT" in c else ""
    elif "BLOCK_M" in c:
        s = (f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{config.num_warps} "
             f"s{config.num_stages}") + (f" k{c['SPLIT_K']}" if "SPLIT_K" in c else "")
    else:
        s = f"gemv n{c['BLOCK_N']} k{c['BLOCK_K']} w{config.num_warps}" + (
            f" k{c['SPLIT_K']}" if "SPLIT_K" in c else "")
    if grid is not None:
        s += f" grid={grid[0]}x{grid[1]}x{grid[2]}"
    return s


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class Sweep:
    def __init__(self, args):
        from kiln.target import detect_cuda, get_target

        self.args = args
        self.target = get_target(args.target) if args.target else detect_cuda()
        self.deadline = time.monotonic() + args.budget
        self.details: list[dict] = []
        self.summary: list[dict] = []
        base = json.loads(BASELINE.read_text()) if BASELINE.exists() else {"specs": {}}
        self.baseline, self.baseline_commit = base["specs"], base.get("commit", "?")

    # preparing ------------------------------------------------------------------
    def prepare(self, case, dtype):
        """(region, plan, [(label, spec, config)]) of one case."""
        from kiln.codegen.autotune.candidates import candidates
        from kiln.codegen.build.spec import KernelSpec
        from kiln.codegen.select_kernels import TEMPLATES

        plan = plan_for(case, dtype, self.target.name)
        region = main_region(plan)
        spec = TEMPLATES[region.kind](region, plan, self.target)
        runs = []
        old = self.baseline.get(key(case, dtype))
        if old is not None:
            old_spec = KernelSpec.from_json(old)
            runs.append(("old", old_spec, old_spec.default))
        if spec is not None:
            chosen = candidates(spec, "fast")
            extra = [c for c in spec.configs if c not in chosen][:EXTRA_CONFIGS]
            runs += [("new", spec, c) for c in chosen + extra]
        return region, plan, spec, runs

    def compile_all(self, runs):
        """Binaries (or the reason there is none) for every (spec, config), in parallel."""
        from kiln.codegen.autotune.worker_pool import OK, Job, get_pool

        jobs = [Job(spec, c, self.target, "kiln.codegen.build.compiler:compile_binary")
                for _, spec, c in runs]
        results: dict[int, object] = {}
        pool = get_pool(min(16, os.cpu_count() or 4))
        # stop starting compiles when only the measuring time is left
        reserve = min(MEASURE_RESERVE_S, self.args.budget / 2)  # a small --budget compiles too
        more = lambda: time.monotonic() < self.deadline - reserve  # noqa: E731
        for i, out in pool.run(jobs, 180.0, more):
            results[i] = out.binary if out.status == OK else f"{out.status}: {out.reason}"
        return [results.get(i, "not compiled") for i in range(len(runs))]

    # measuring ------------------------------------------------------------------
    def bench(self, fn) -> float:
        from triton.testing import do_bench

        fn()
        torch.cuda.synchronize()
        return float(do_bench(fn, warmup=10, rep=self.args.rep_ms, return_mode="median"))

    def run_case(self, case, dtype, region, plan, spec, runs, binaries):
        from kiln.codegen.autotune.timing import example_buffers
        from kiln.codegen.torch_kernel import TorchKernel

        name, phase, _, _, flops, nbytes = case
        dt = str(dtype).replace("torch.", "")
        env: dict[str, int] = {}
        torch.manual_seed(0)
        inputs, outs = example_buffers(region, plan, env, "cuda")
        ref = {o: torch.empty_like(t) for o, t in outs.items()}
        extern = TorchKernel(region, "cuda")
        extern.run(inputs, ref, env)
        row = {"case": name, "phase": phase, "dtype": dt, "flops": flops, "bytes": nbytes,
               "torch_ms": self.bench(lambda: extern.run(inputs, ref, env))}
        default = spec.default if spec is not None else None
        for (label, s, config), binary in zip(runs, binaries):
            d = {"case": name, "phase": phase, "dtype": dt, "which": label,
                 "config": describe(s, config), "default": label == "new" and config == default}
            if time.monotonic() > self.deadline:
                d["error"] = "skipped: time budget spent"
            elif isinstance(binary, str):
                d["error"] = binary
            else:
                try:
                    d.update(self.measure(region, s, config, binary, inputs, outs, ref, env))
                except Exception as e:  # one bad config must not end the sweep
                    d["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            self.details.append(d)
            self.print_detail(d)
        mine = [d for d in self.details if d["case"] == name and d["phase"] == phase
                and d["dtype"] == dt]
        ok = [d for d in mine if "ms" in d and d["err"] < self.args.tol]
        best = min((d for d in ok if d["which"] == "new"), key=lambda d: d["ms"], default=None)
        old = next((d for d in ok if d["which"] == "old"), None)
        dflt = next((d for d in ok if d["default"]), None)
        row.update(new_ms=best and best["ms"], new_config=best and best["config"],
                   new_err=best and best["err"], old_ms=old and old["ms"],
                   old_config=old and old["config"], default_ms=dflt and dflt["ms"],
                   failed=len(mine) - len(ok))
        self.summary.append(row)

    def measure(self, region, spec, config, binary, inputs, outs, ref, env) -> dict:
        from kiln.codegen.build.triton_kernel import TritonKernel

        kernel = TritonKernel(region, spec, config, binary)
        for t in outs.values():
            t.fill_(float("nan"))  # every element must be written
        kernel.run(inputs, outs, env)
        torch.cuda.synchronize()
        err = max(rel_err(outs[o], ref[o]) for o in outs)
        args, sizes = kernel.launch_args(inputs, outs, env)
        grid = spec.grid_for(sizes, config)
        launch = binary.kernel(spec, config)[grid]
        ms = self.bench(lambda: launch(*args))
        res = binary.resources
        return {"ms": ms, "err": err, "grid": list(grid), "config": describe(spec, config, grid),
                "regs": res.registers, "shared": res.shared, "spills": res.spills}

    # printing ---------------------------------------------------------------------
    @staticmethod
    def print_detail(d: dict) -> None:
        head = f"  {d['case']:16} {d['phase']:7} {d['dtype']:8} {d['which']:3}"
        if "error" in d:
            print(f"{head} {'ERROR':>9}  {d['config']}: {d['error'][:150]}", flush=True)
            return
        flag = " <- default" if d["default"] else ""
        bad = "  WRONG" if not d["err"] < 1e-2 else ""
        print(f"{head} {d['ms']:9.4f}  err {d['err']:.1e}  regs {d['regs']} smem "
              f"{d['shared']}  {d['config']}{flag}{bad}", flush=True)

    def table(self) -> list[str]:
        def ms(x):
            return f"{x:8.4f}" if x else "       -"

        def ratio(a, b):
            return f"{a / b:6.2f}" if a and b else "     -"

        def rate(r):
            if not r.get("new_ms"):
                return "        -"
            s = r["new_ms"] * 1e-3
            if r["phase"] == "prefill":
                return f"{r['flops'] / s / 1e12:5.0f} TF/s"
            return f"{r['bytes'] / s / 1e9:5.0f} GB/s"

        lines = [f"{'case':16} {'phase':7} {'dtype':8} {'torch':>8} {'old':>8} {'new':>8} "
                 f"{'dflt':>8} {'t/new':>6} {'old/new':>7} {'new rate':>10}  new config"]
        for r in self.summary:
            if "error" in r:
                lines.append(f"{r['case']:16} {r['phase']:7} {r['dtype']:8} ERROR "
                             f"{r['error'][:120]}")
                continue
            fails = f" ({r['failed']} failed)" if r.get("failed") else ""
            lines.append(
                f"{r['case']:16} {r['phase']:7} {r['dtype']:8} {ms(r['torch_ms'])} "
                f"{ms(r['old_ms'])} {ms(r['new_ms'])} {ms(r['default_ms'])} "
                f"{ratio(r['torch_ms'], r['new_ms'])} {ratio(r['old_ms'], r['new_ms']):>7} "
                f"{rate(r):>10}  {r.get('new_config') or '-'}{fails}")
        return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float16,bfloat16")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--cache", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--only", default=None, help="comma-separated case names")
    p.add_argument("--rep-ms", type=float, default=40.0, help="do_bench repetition time")
    p.add_argument("--tol", type=float, default=2e-2, help="rel err a result must beat")
    p.add_argument("--budget", type=float, default=220.0, help="seconds before skipping")
    p.add_argument("--target", default=None, help="default: the local GPU's")
    p.add_argument("--compile-only", action="store_true", help="no GPU: compile, report")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import triton

    sweep = Sweep(args)
    t0 = time.monotonic()
    prepared = []
    for dt in args.dtypes.split(","):
        dtype = getattr(torch, dt)
        for case in cases(args.prefill, args.cache, args.batch):
            if args.only and case[0] not in args.only.split(","):
                continue
            try:
                prepared.append((case, dtype, *sweep.prepare(case, dtype)))
            except Exception as e:
                sweep.summary.append({"case": case[0], "phase": case[1],
                                      "dtype": dt, "error": f"prepare: {type(e).__name__}: {e}"})
    all_runs = [r for *_, runs in prepared for r in runs]
    print(f"compiling {len(all_runs)} kernels for {sweep.target.name} "
          f"({time.monotonic() - t0:.0f} s so far)", flush=True)
    try:
        binaries = sweep.compile_all(all_runs)
    except Exception as e:
        binaries = [f"compile pool failed: {e}"] * len(all_runs)
    print(f"compiled ({time.monotonic() - t0:.0f} s so far)", flush=True)
    if args.compile_only:
        for (label, spec, c), b in zip(all_runs, binaries):
            r = None if isinstance(b, str) else b.resources
            what = b if r is None else f"regs {r.registers} spills {r.spills} smem {r.shared}"
            print(f"  {spec.name:36} {label:3} {describe(spec, c):28} {what}")
        return
    at = 0
    for case, dtype, region, plan, spec, runs in prepared:
        mine, at = binaries[at:at + len(runs)], at + len(runs)
        try:
            sweep.run_case(case, dtype, region, plan, spec, runs, mine)
        except Exception as e:
            traceback.print_exc()
            sweep.summary.append({"case": case[0], "phase": case[1],
                                  "dtype": str(dtype).replace("torch.", ""),
                                  "error": f"{type(e).__name__}: {e}"})
    lines = sweep.table()
    head = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
            f"{triton.__version__}, target {sweep.target.name}; old = templates at "
            f"{sweep.baseline_commit}; ms are medians, L2 flushed; "
            f"{time.monotonic() - t0:.0f} s")
    print("\n" + head + "\n" + "\n".join(lines), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"header": head, "table": lines, "summary": sweep.summary,
             "details": sweep.details}, indent=1, default=str))


if __name__ == "__main__":
    main()
