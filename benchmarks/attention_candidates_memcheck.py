"""Every candidate config of one attention kernel, each run alone in its own process:
to find, under compute-sanitizer, which config faults (issue 13).

The kernel is the expanded prefill attention of the tiny DeepSeek-V3 fp8 model of
tests/models/test_deepseek_v3_fp8_gpu.py (8 heads, q/k head dim 24, value head dim
16, a float mask, RoPE fused into the loads), whose timing faulted on an H100 with
`Invalid __shared__ read of size 512 bytes` in its P @ V tl.dot. The region and its
KernelSpec are captured in a process that sees no GPU (CUDA_VISIBLE_DEVICES="", so
the model compiles for cuda:sm_90 compile-only and nothing runs); then each candidate
(the tuner's "full" list, the "fast" ones marked) compiles and runs once at each
size in a fresh child process, checked against the region's torch form. This
process never touches CUDA, so a faulting candidate costs only its child.

    python benchmarks/attention_candidates_memcheck.py --out /tmp/attn_candidates.json
    python benchmarks/attention_candidates_memcheck.py --memcheck --fast --out /tmp/mc.json
    python benchmarks/attention_candidates_memcheck.py --memcheck --only 0,1,2 --out ...

--memcheck wraps each child in `compute-sanitizer --tool memcheck` and records its
error count and first report lines per config. The printed lines name each config
as it starts ("=== [i/n] <config> seq=<T>"), so the whole script can also run under
one compute-sanitizer (it follows child processes; then use --jobs 1). --fast runs
only the 8 fast-mode candidates (the ones the failing run timed); --jobs runs that
many candidates side by side. --small runs three candidates at one size (a smoke
run; on a machine without a GPU, only the capture).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class _Captured(BaseException):
    """Stops the model's compile once the attention spec is in hand."""


def capture(path: Path, sizes: list[int]) -> None:
    """Pickle {"spec", "region", "buffers": {T: Buffers}, "fast": [config str]} of the
    model's first attention region to `path` (run with no GPU visible)."""
    import kiln.models
    from kiln.codegen import select_kernels
    from kiln.codegen.autotune.candidates import candidates
    from kiln.codegen.autotune.timing import buffer_specs
    from kiln.codegen.expr.values import CodegenUnsupported
    from kiln.codegen.templates.attention import template as attention
    from kiln.ir.plan import RegionKind
    from tests.models.test_deepseek_v3 import make_hf_model
    from tests.models.test_deepseek_v3_fp8 import write_fp8_checkpoint

    hf = make_hf_model(seed=5, intermediate_size=200, num_attention_heads=8,
                       num_key_value_heads=8, q_lora_rank=136)  # as the GPU test's
    ckpt = Path(tempfile.mkdtemp(prefix="kiln-dsv3-fp8-"))
    write_fp8_checkpoint(ckpt, hf)

    def skip(region, plan, target):  # every other region: torch ops, nothing compiled
        raise CodegenUnsupported("not the kernel under test")

    def record(region, plan, target):
        spec = attention.generate(region, plan, target)
        seq = [s for s, b in plan.symbols.items() if b.hi != b.lo]
        buffers = {t: buffer_specs(region, plan, {**{s: b.lo for s, b in plan.symbols.items()},
                                                  **{s: t for s in seq}},
                                   spec.meta.get("timing_fill")) for t in sizes}
        with open(path, "wb") as f:
            pickle.dump({"spec": spec, "region": region, "buffers": buffers,
                         "sizes": {t: {s: t for s in seq} | {s: b.lo for s, b in
                                                              plan.symbols.items()
                                                              if s not in seq}
                                   for t in sizes},
                         "fast": [str(c) for c in candidates(spec, "fast")]}, f)
        raise _Captured

    for kind in list(select_kernels.TEMPLATES):
        select_kernels.TEMPLATES[kind] = record if kind == RegionKind.ATTENTION else skip
    for op in list(select_kernels.EXTERN_TEMPLATES):
        select_kernels.EXTERN_TEMPLATES[op] = skip
    try:
        kiln.models.load(ckpt, target="cuda:sm_90", max_seq_len=32)
    except _Captured:
        return
    raise SystemExit("the model compiled without an attention region to capture")


def run_one(path: Path, index: int, sizes: list[int]) -> None:
    """Compile candidate `index` for this GPU and run it once per size; print RESULT."""
    import torch

    from kiln.codegen.autotune.candidates import candidates
    from kiln.codegen.autotune.timing import make_buffers
    from kiln.codegen.build.compiler import compile_binary
    from kiln.codegen.build.triton_kernel import TritonKernel
    from kiln.codegen.torch_kernel import TorchKernel
    from kiln.target import detect_cuda

    got = pickle.loads(path.read_bytes())
    spec, region = got["spec"], got["region"]
    config = candidates(spec, "full")[index]
    binary = compile_binary(spec, config, detect_cuda())
    kernel = TritonKernel(region, spec, config, binary)
    out = {"config": str(config), "shared": binary.resources.shared,
           "registers": binary.resources.registers, "rel_err": {}}
    for t in sizes:
        env = got["sizes"][t]
        inputs, outs = make_buffers(got["buffers"][t], "cuda")
        want = {k: torch.empty_like(v) for k, v in outs.items()}
        TorchKernel(region, "cuda").run(inputs, want, env)
        kernel.run(inputs, outs, env)
        torch.cuda.synchronize()
        (name,) = outs
        w, g = want[name].double(), outs[name].double()
        out["rel_err"][t] = float((g - w).norm() / w.norm().clamp_min(1e-30))
    print("RESULT " + json.dumps(out), flush=True)


def _child(path: Path, index: int, sizes: list[int], memcheck: bool, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--run-one", str(index), "--spec", str(path),
           "--sizes", ",".join(map(str, sizes))]
    if memcheck:
        cmd = ["compute-sanitizer", "--tool", "memcheck", "--print-limit", "5",
               "--kernel-name", "kns=kiln_attention", *cmd]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", "".join(x.decode(errors="replace") if isinstance(x, bytes)
                                      else x or "" for x in (e.stdout, e.stderr))
    rec = {"rc": rc, "seconds": round(time.time() - t0, 1)}
    m = re.search(r"^RESULT (.*)$", text, re.M)
    if m:
        rec.update(json.loads(m.group(1)))
    errors = re.search(r"ERROR SUMMARY: (\d+) error", text)
    if errors:
        rec["memcheck_errors"] = int(errors.group(1))
    rec["report"] = [s.strip() for s in text.splitlines()
                     if re.search(r"Invalid|out of bounds|illegal|Error|error:", s)][:8]
    rec["status"] = ("ok" if m and rc == 0 and not rec.get("memcheck_errors")
                     else "fault" if rec.get("memcheck_errors") or "illegal" in text
                     else "failed")
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="attention_candidates_memcheck.json")
    ap.add_argument("--memcheck", action="store_true",
                    help="wrap each candidate's process in compute-sanitizer memcheck")
    ap.add_argument("--sizes", default="9,32", help="query lengths (the test's 9, the timed 32)")
    ap.add_argument("--only", default=None, help="comma-separated candidate indices")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per candidate")
    ap.add_argument("--small", action="store_true", help="three candidates, one size")
    ap.add_argument("--fast", action="store_true", help="only the fast-mode candidates "
                    "(those the failing run timed)")
    ap.add_argument("--jobs", type=int, default=4, help="candidates run side by side")
    ap.add_argument("--run-one", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--capture", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")][: 1 if args.small else None]
    if args.capture:
        return capture(Path(args.capture), sizes)
    if args.run_one is not None:
        return run_one(Path(args.spec), args.run_one, sizes)

    path = Path(tempfile.mkdtemp(prefix="kiln-attn-memcheck-")) / "spec.pkl"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    subprocess.run([sys.executable, __file__, "--capture", str(path), "--sizes",
                    ",".join(map(str, sizes))], check=True, env=env)
    got = pickle.loads(path.read_bytes())
    from kiln.codegen.autotune.candidates import candidates

    configs = candidates(got["spec"], "full")
    print(f"kernel {got['spec'].name}: {len(configs)} candidates "
          f"({len(got['fast'])} in fast mode), meta {got['spec'].meta}", flush=True)
    picks = ([int(i) for i in args.only.split(",")] if args.only
             else [i for i, c in enumerate(configs) if str(c) in got["fast"]] if args.fast
             else range(3) if args.small else range(len(configs)))
    have_gpu = subprocess.run([sys.executable, "-c", "import torch,sys; "
                               "sys.exit(0 if torch.cuda.is_available() else 1)"]).returncode == 0

    lock = threading.Lock()

    def say(text: str) -> None:
        with lock:
            print(text, flush=True)

    def one(i: int) -> dict:
        c = configs[i]
        say(f"=== [{i}/{len(configs)}] {c}{' (fast)' if str(c) in got['fast'] else ''} "
            f"seq={sizes}")
        rec = {"index": i, "config": str(c), "fast": str(c) in got["fast"]}
        if not have_gpu:
            return {**rec, "status": "not run (no GPU)"}
        rec.update(_child(path, i, sizes, args.memcheck, args.timeout))
        say(f"    [{i}] {c}: {rec['status']}: rel_err {rec.get('rel_err')} shared "
            f"{rec.get('shared')} memcheck {rec.get('memcheck_errors')} {rec['report'][:2]}")
        return rec

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(one, picks))
    faulty = [r["config"] for r in results if r.get("status") == "fault"]
    print("faulting configs:", faulty or "none", flush=True)
    Path(args.out).write_text(json.dumps({
        "kernel": got["spec"].name, "meta": got["spec"].meta, "sizes": sizes,
        "memcheck": args.memcheck, "faulting": faulty, "candidates": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
