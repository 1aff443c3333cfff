"""How long kiln takes to make a Llama-3-8B-shaped model ready to generate, phase by phase:
a cold compile (empty KILN_CACHE_DIR), a warm one (the same cache: compiled modules and
tuning results), a warm one with the compile cache off (tuning results only) and loading
the LLM the cold one saved (issue 10's targets: 60 s, 15 s and 5 s weights aside).

Each step runs in a fresh process sharing one new KILN_CACHE_DIR, as separate `kiln`
invocations would, and reports the phases kiln recorded (kiln.progress.phase: the
CompiledModule's compile_timings, summed over the prefill and decode modules), the
LLM's own wall time and the process's (imports included).

    # a machine without the GPU: compile-only for sm_90, weights on the meta device
    python benchmarks/compile_time.py --target cuda:sm_90 --out compile_time_cpu.json
    # the H100: random weights on the GPU, CUDA graphs captured, prefill warmed
    python benchmarks/compile_time.py --target cuda --out compile_time_h100.json

The saved LLM holds one tensor per distinct weight shape, read under every name of that
shape (`alias_weights`): the plan, kernels and checks are the 8B's, the weights file a
few GB instead of 16, and the load's own weights phase is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# warm-tuned: a second compile with the compile cache off (tuning results cached only)
STEPS = ("cold", "warm", "warm-tuned", "load")


def build_llm(args):
    """The LLM kiln.models.load would give for the preset, compiled now."""
    import torch

    from kiln.models.generate import LLM
    from kiln.models.hf import DTYPES, build_model, random_model
    from kiln.models.llama import PRESETS
    from kiln.models.tokenizer import ByteTokenizer
    from kiln.target import get_target

    changes = {"max_seq_len": args.max_seq_len}
    if args.layers is not None:
        changes["n_layers"] = args.layers
    cfg = PRESETS[args.preset].with_(**changes)
    dtype = DTYPES[args.dtype]
    target = get_target(args.target)
    if target.is_gpu and torch.cuda.is_available():
        model = random_model(cfg, dtype, target.torch_device)
    else:  # compile-only: kiln exports meta examples for a model on the meta device
        with torch.device("meta"):
            model = build_model(cfg).to(dtype)
        model.init_rope("meta")
        model.eval()
    t0, c0 = time.perf_counter(), os.times()
    llm = LLM(model, ByteTokenizer(), (), target=target, max_batch_size=args.max_batch_size,
              paged=args.cache == "paged", name=args.preset)
    c1 = os.times()
    # this process's CPU seconds (not its compile workers'): steadier than wall time on
    # a machine other work shares
    llm.bench_cpu_s = c1.user + c1.system - c0.user - c0.system
    return llm, time.perf_counter() - t0


def alias_weights(llm) -> None:
    """Give every weight of the compiled modules one real tensor per (shape, dtype), shared
    by all names of that shape, and every KV cache its own; saved, each shared tensor is
    stored once. Only for saving what this benchmark loads: the LLM computes garbage."""
    import torch

    from kiln.ir.plan import Role

    by_shape: dict = {}
    for module in llm.modules():
        states = {v.target for v in module.plan.values.values()
                  if v.role == Role.STATE and v.target is not None}
        for name, t in module.state.items():
            if name in states:
                if t.is_meta:
                    module.state[name] = by_shape.setdefault(
                        ("state", name), torch.zeros(t.shape, dtype=t.dtype))
                continue
            key = (tuple(t.shape), t.dtype, t.device.type)
            if key not in by_shape:
                dev = "cpu" if t.is_meta else t.device
                by_shape[key] = torch.zeros(t.shape, dtype=t.dtype, device=dev)
            module.state[name] = by_shape[key]


def phases_of(module_timings: list[dict[str, float]]) -> dict[str, float]:
    """The modules' compile phases, summed, by the names the report uses."""
    total: dict[str, float] = {}
    for timings in module_timings:
        for k, v in timings.items():
            total[k] = total.get(k, 0.0) + v
    out = {}
    capture = total.get("import/export/capture", 0.0)
    decompose = total.get("import/export/decompose", 0.0)
    out["export (torch.export)"] = capture
    out["decompositions"] = decompose
    out["import (rest)"] = total.get("import/export", 0.0) - capture - decompose
    select = "codegen/select_kernels"
    parts = {"templates": "kernel templates", "build": "kernel build",
             "timing": "tuning (GPU timing)", "cache": "tuning cache"}
    for key, v in sorted(total.items()):
        if key.startswith(("import/", select, "compile_cache/")) or key.count("/") > 1:
            continue
        name = {"compile_cache": "compile cache (keep / hit)",
                "weights": "weights onto the device"}.get(key, key)
        out[f"pass {key}" if "/" in key else name] = v
    out[f"pass {select} (rest)"] = total.get(select, 0.0) - sum(
        total.get(f"{select}/{p}", 0.0) for p in parts)
    for p, name in parts.items():
        out[name] = total.get(f"{select}/{p}", 0.0)
    background = total.get(f"{select}/build (background)")
    if background is not None:  # KILN_TUNE_OVERLAP=1: "kernel build" is then the waits
        out["kernel build in the background (overlaps the rest)"] = background
    return out


def step(args) -> dict:
    """One step, in this process."""
    import kiln
    from kiln.progress import recording, top_level

    if args.step == "load":
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        with recording(timings):
            if args.runnable:
                import kiln.models

                kiln.models.load(args.saved)
            else:  # the GPU is not here: what LLM.load reads, without its warm-up
                kiln.load_modules(args.saved)
        total = time.perf_counter() - t0
        weights = sum(v for k, v in timings.items() if k.rpartition("/")[2] == "weights")
        return {"load_s": total, "weights_s": weights, "load_without_weights_s":
                total - weights, "phases": timings}
    llm, wall = build_llm(args)
    # prefill and decode (its narrow version's phases under "narrow/")
    compile_timings = [m.compile_timings for m in llm.modules()]
    modules = sum(sum(top_level(t).values()) for t in compile_timings)
    out = {"compile_s": llm.compile_s, "llm_s": wall, "modules_s": modules,
           "cpu_s": llm.bench_cpu_s,
           "ready_s": llm.load_s if llm.runnable else 0.0,
           "regions": sum(len(m.plan.regions) for m in llm.modules()),
           "phases": phases_of(compile_timings),
           "prefill_phases": compile_timings[0], "decode_phases": compile_timings[1]}
    out["phases"]["LLM other (cache set-up, examples)"] = llm.compile_s - modules
    if llm.runnable:
        out["phases"]["CUDA graphs + warm prefill"] = llm.load_s
    if args.step == "cold":
        alias_weights(llm)
        t0 = time.perf_counter()
        llm.save(args.saved)
        out["save_s"] = time.perf_counter() - t0
        files = [f for f in Path(args.saved).rglob("*") if f.is_file()]
        out["saved_bytes"] = sum(f.stat().st_size for f in files)
        out["kernel_files"] = sum(1 for f in files if f.parent.name == "kernels")
    return out


def run_step(name: str, args, cache: Path, runnable: bool) -> dict:
    env = dict(os.environ, KILN_CACHE_DIR=str(cache), KILN_PROGRESS="0",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if name == "warm-tuned":
        env["KILN_COMPILE_CACHE"] = "0"
    cmd = [sys.executable, __file__, "--step", name, "--saved", args.saved,
           "--preset", args.preset, "--target", args.target, "--dtype", args.dtype,
           "--max-seq-len", str(args.max_seq_len), "--max-batch-size",
           str(args.max_batch_size), "--cache", args.cache]
    if args.layers is not None:
        cmd += ["--layers", str(args.layers)]
    if runnable:
        cmd.append("--runnable")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"step {name} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = wall
    return result


def table(results: dict) -> str:
    names = [n for n in ("cold", "warm", "warm-tuned") if n in results]
    rows = list(dict.fromkeys(k for n in names for k in results[n]["phases"]))
    lines = [f"{'phase':<44}" + "".join(f"{n:>11}" for n in names)]
    for row in rows:
        vals = [results[n]["phases"].get(row, 0.0) for n in names]
        if max(vals) >= 0.05:
            lines.append(f"{row:<44}" + "".join(f"{v:>11.2f}" for v in vals))
    for key, label in (("compile_s", "LLM compile (kiln.models.load's)"),
                       ("cpu_s", "  its CPU time (this process)"),
                       ("process_wall_s", "process (imports included)")):
        lines.append(f"{label:<44}" + "".join(f"{results[n][key]:>11.2f}" for n in names))
    if "load" in results:
        r = results["load"]
        lines.append(f"load: {r['load_s']:.2f} s, weights {r['weights_s']:.2f} s, "
                     f"without weights {r['load_without_weights_s']:.2f} s "
                     f"(process {r['process_wall_s']:.2f} s)")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--layers", type=int, default=None, help="default: the preset's")
    p.add_argument("--target", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--cache", default="paged", choices=["paged", "contiguous"])
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    p.add_argument("--cache-dir", help="KILN_CACHE_DIR for every step (default: a new one)")
    p.add_argument("--out", help="JSON results (required unless --step)")
    p.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)
    p.add_argument("--saved", help=argparse.SUPPRESS)
    p.add_argument("--runnable", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.step:
        print(json.dumps(step(args)))
        return
    if not args.out:
        p.error("--out is required")
    import torch

    from kiln.target import get_target

    target = get_target(args.target)
    runnable = not target.is_gpu or torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="kiln-compile-time-") as tmp:
        cache = Path(args.cache_dir or Path(tmp) / "cache")
        args.saved = str(Path(tmp) / "llm.kiln")
        results = {}
        for name in args.steps:
            if name == "load" and not Path(args.saved).exists():
                continue  # nothing saved: the cold step did not run
            results[name] = run_step(name, args, cache, runnable)
    report = {"preset": args.preset, "layers": args.layers, "target": target.name,
              "compile_only": not runnable, "dtype": args.dtype, "cache": args.cache,
              "max_seq_len": args.max_seq_len, "max_batch_size": args.max_batch_size,
              "cpus": os.cpu_count(), "steps": results}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
