"""Generated pointwise and reduction kernels vs the GPU's copy bandwidth.

For each case kiln compiles a small module for the local GPU (target "cuda") and times
its generated kernel alone (triton.testing.do_bench, median, L2 flushed between runs)
on large inputs. Bandwidth counts every byte the kernel must move: each input tensor
read once, each output written once. The reference is torch's device-to-device copy_
of a 1 GiB buffer (bytes read + written). Goal: >= 80% of copy bandwidth.

    PYTHONPATH=. python benchmarks/bandwidth.py --out bandwidth.txt [--sweep] [--only softmax]

(--out: a .json path gets JSON only; any other path, the table followed by the JSON.)

Kernels run at the config kiln's autotuner picks (--tune fast, the default; --tune none
for the heuristic default). Each row names the row kernel's form (persistent: the row
held in registers; looped: swept in chunks; split: few rows divided among programs,
partial sums added atomically into the output, which the launch zeroes first, and the
timing includes that) and the config. A kernel under 80% also prints the tuner's note
(every candidate's time). --sweep also times up to --max-configs candidate configs
(compiled here) and reports the best. Runs on torch 2.11 / triton 3.6 and later.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import kiln
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.ir.symbolic import evaluate
from kiln.target import get_target


class Fn(torch.nn.Module):
    def __init__(self, fn, params=None):
        super().__init__()
        self.fn = fn
        for k, v in (params or {}).items():
            self.register_parameter(k, torch.nn.Parameter(v, requires_grad=False))

    def forward(self, *xs):
        return self.fn(self, *xs)


def rmsnorm(m, x):
    h = x.float()
    return m.w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def layernorm(m, x):
    return F.layer_norm(x, (x.shape[-1],), m.w, m.b)


N = 1 << 26  # 64M elements: 256 MB per fp32 tensor


LOOPED_32000 = "softmax 32000, looped form"


@contextlib.contextmanager
def looped_rows(name: str):
    """For the LOOPED_32000 case: hold no row over 16384 whole (the limit before rows of
    32768 were), so the looped form's time stands beside the persistent one's."""
    if name != LOOPED_32000:
        yield
        return
    import kiln.codegen.templates.reduction.row_kernel as reduction

    held = reduction.persistent_limit
    reduction.persistent_limit = lambda *a: min(16384, held(*a))
    try:
        yield
    finally:
        reduction.persistent_limit = held


def cases(dtypes):
    """(name, module, input shapes, input dtype, weights) for each benchmark."""
    low = [d for d in dtypes if d != torch.float32]
    out = []
    for dt in dtypes:
        out.append(("x*y+z", lambda m, x, y, z: x * y + z, [(N,)] * 3, dt, {}))
    for dt in low:
        out.append(("silu(x)*y (SwiGLU)", lambda m, x, y: F.silu(x) * y,
                    [(8192, 14336)] * 2, dt, {}))
        out.append((f"cast {_n(dt)}->f32", lambda m, x: x.float(), [(N,)], dt, {}))
        out.append((f"cast f32->{_n(dt)}", lambda m, x, dt=dt: x.to(dt), [(N,)],
                    torch.float32, {}))
    for dt in dtypes:
        for hidden in (4096, 8192):
            rows = (1 << 26) // hidden
            out.append((f"rmsnorm rows of {hidden}", rmsnorm, [(rows, hidden)], dt,
                        {"w": (hidden,)}))
        out.append(("layer_norm rows of 4096", layernorm, [(1 << 14, 4096)], dt,
                    {"w": (4096,), "b": (4096,)}))
        # 32000 (Llama-2 vocabulary): held whole; 128256 (Llama-3): looped, online softmax
        for cols in (4096, 32000, 128256):
            if cols == 128256 and dt == torch.float16:
                continue  # as bf16
            out.append((f"softmax rows of {cols}", lambda m, x: torch.softmax(x, -1),
                        [((1 << 26) // cols, cols)], dt, {}))
        if dt != torch.float16:  # the same rows forced into the looped form, to compare
            out.append((LOOPED_32000, lambda m, x: torch.softmax(x, -1),
                        [((1 << 26) // 32000, 32000)], dt, {}))
    f32 = torch.float32
    out.append(("sum over rows (dim -1)", lambda m, x: x.sum(-1), [(1 << 14, 4096)], f32, {}))
    # column reductions: few outputs, so the split form (fp32 sums and means)
    out.append(("sum over columns (dim 0)", lambda m, x: x.sum(0), [(4096, 1 << 14)], f32, {}))
    out.append(("sum dim 0 of 8192x8192", lambda m, x: x.sum(0), [(8192, 8192)], f32, {}))
    out.append(("mean dim 0 of 8192x8192", lambda m, x: x.mean(0), [(8192, 8192)], f32, {}))
    if torch.bfloat16 in dtypes:  # a bf16 result cannot take atomics: the looped form
        out.append(("mean dim 0 of 8192x8192", lambda m, x: x.mean(0), [(8192, 8192)],
                    torch.bfloat16, {}))
    out.append(("sum dim 1 of 16x4096x1024", lambda m, x: x.sum(1), [(16, 4096, 1024)], f32,
                {}))
    out.append(("sum of all (x.sum())", lambda m, x: x.sum(), [(N,)], f32, {}))
    return out


def _rel_err(out, ref) -> float:
    """The largest ||out - ref|| / ||ref|| over the outputs (in fp64)."""
    outs = out if isinstance(out, (tuple, list)) else [out]
    refs = ref if isinstance(ref, (tuple, list)) else [ref]
    errs = [float((o.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30))
            for o, r in zip(outs, refs)]
    return max(errs, default=0.0)


def _n(dt: torch.dtype) -> str:
    return {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dt]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def launcher(kernel: TritonKernel, inputs, outs, env, config=None, binary=None):
    """A zero-argument launch of `kernel` (its binary, args and grid fixed once), with
    the zeroing of the outputs it adds into, as TritonKernel.run does."""
    args, sizes = kernel.launch_args(inputs, outs, env)
    config = config or kernel.config
    # the launcher takes every parameter, constexpr tunables included (as TritonKernel.run)
    args = args[: len(kernel.spec.args)] + [config[t] for t in kernel.spec.tunables]
    grid = kernel.spec.grid_for(sizes, config)
    fn = (binary or kernel.binary).kernel(kernel.spec, config)
    zeroed = [outs[v] for v in kernel.spec.zero_outputs]

    def launch():
        for t in zeroed:
            t.zero_()
        fn[grid](*args)
    return launch


def region_tensors(exe, region, flat, env):
    """Inputs (user args, weights, or random stand-ins for intermediates) and outputs."""
    plan = exe.plan
    given = dict(zip(plan.user_inputs, flat))
    inputs = {}
    for v in region.inputs:
        tv = plan.values[v]
        if v in given:
            inputs[v] = given[v]
        elif tv.target is not None:
            inputs[v] = exe.state[tv.target]
        else:
            shape = [evaluate(d, env) for d in tv.shape]
            inputs[v] = torch.randn(shape, device="cuda").to(tv.dtype)
    outs = {o: torch.empty([evaluate(d, env) for d in plan.values[o].shape],
                           dtype=plan.values[o].dtype, device="cuda") for o in region.outputs}
    return inputs, outs


def moved_bytes(inputs, outs) -> int:
    seen, total = set(), 0
    for t in list(inputs.values()) + list(outs.values()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def sweep(kernel: TritonKernel, inputs, outs, env, target, limit: int):
    """Time up to `limit` candidate configs (spread over the list); best (ms, config)."""
    configs = kernel.spec.configs
    if len(configs) > limit:
        step = len(configs) / limit
        configs = [configs[int(i * step)] for i in range(limit)]
    best = (float("inf"), None)
    for cfg in configs:
        try:
            binary = compile_binary(kernel.spec, cfg, target)
            if binary.resources.shared > target.shared_mem_per_block:
                continue
            ms = do_bench(launcher(kernel, inputs, outs, env, cfg, binary),
                          return_mode="median")
        except Exception as e:  # a failing candidate is skipped, as the tuner would
            print(f"    config {cfg} failed: {type(e).__name__}")
            continue
        best = min(best, (ms, cfg), key=lambda t: t[0])
    return best


def run_case(name, fn, shapes, dtype, weights, copy_gbs, target, args):
    params = {k: torch.randn(s, device="cuda").to(dtype) for k, s in weights.items()}
    module = Fn(fn, params).cuda()
    xs = [torch.randn(s, device="cuda").to(dtype) for s in shapes]
    workers = max(1, min(8, (os.cpu_count() or 2) // 2))  # candidates compile in parallel
    with looped_rows(name):
        exe = kiln.compile(module, tuple(xs), target=target,
                           options={"tune": args.tune, "tune_workers": workers})
    env = exe.program.bind(xs, exe.plan.user_inputs)
    err = _rel_err(exe(*xs), module(*xs))
    ok = err <= (1e-5 if dtype == torch.float32 else 1e-2)
    if not ok:
        print(f"  {name} {_n(dtype)}: WRONG: relative error {err:.2e} vs eager")
    rows = []
    for region in exe.plan.regions:
        kernel = exe.program.kplan.kernels[region.name]
        if not isinstance(kernel, TritonKernel):
            print(f"  {name} {_n(dtype)}: region {region.name} runs extern: {region.notes}")
            continue
        inputs, outs = region_tensors(exe, region, xs, env)
        nbytes = moved_bytes(inputs, outs)
        ms = do_bench(launcher(kernel, inputs, outs, env), return_mode="median")
        gbs = nbytes / (ms * 1e-3) / 1e9
        form = kernel.spec.meta.get("form", kernel.spec.template)
        row = {"case": name, "dtype": _n(dtype), "shape": [list(s) for s in shapes],
               "kernel": kernel.spec.name, "form": form, "config": str(kernel.config),
               "grid": list(kernel.spec.grid_for(kernel.sizes(env),
                                                 kernel.config)),
               "us": ms * 1e3, "bytes": nbytes, "GB/s": gbs, "pct_copy": 100 * gbs / copy_gbs,
               "rel_err": err, "correct": ok,
               "tuner": [n for n in region.notes if n.startswith(("tuned", "extern"))]}
        if args.sweep:
            best_ms, best_cfg = sweep(kernel, inputs, outs, env, target, args.max_configs)
            if best_cfg is not None:
                bgbs = nbytes / (best_ms * 1e-3) / 1e9
                row.update({"best_config": str(best_cfg), "best_us": best_ms * 1e3,
                            "best_GB/s": bgbs, "best_pct_copy": 100 * bgbs / copy_gbs})
        rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where to write the results (JSON)")
    ap.add_argument("--dtypes", default="f32,f16,bf16", help="comma list of f32,f16,bf16")
    ap.add_argument("--tune", default="fast", choices=["none", "fast", "full"],
                    help="kiln's autotuning mode for the compiled kernels (none: heuristic)")
    ap.add_argument("--sweep", action="store_true", help="also time candidate configs")
    ap.add_argument("--max-configs", type=int, default=24, help="configs per sweep")
    ap.add_argument("--only", default=None,
                    help="run cases whose name contains one of these (comma-separated)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bandwidth.py needs a CUDA GPU")
    names = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    dtypes = [names[d] for d in args.dtypes.split(",")]
    target = get_target("cuda")
    copy_gbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  target {target}  torch {torch.__version__}  "
          f"triton {triton.__version__}\ncopy_ bandwidth: {copy_gbs:.0f} GB/s (read + write)\n")
    head = (f"{'case':28} {'dtype':5} {'form':10} {'config':36} {'us':>9} {'GB/s':>7} "
            f"{'%copy':>6}")
    print(head + ("   best config / %copy" if args.sweep else ""))
    rows, table = [], [head]
    only = [w for w in (args.only or "").split(",") if w]
    start = time.perf_counter()
    for name, fn, shapes, dtype, weights in cases(dtypes):
        if only and not any(w in name for w in only):
            continue
        for row in run_case(name, fn, shapes, dtype, weights, copy_gbs, target, args):
            rows.append(row)
            cfg = row["config"].replace(",stages=1", "")
            line = (f"{row['case'][:28]:28} {row['dtype']:5} {row['form'][:10]:10} "
                    f"{cfg[:36]:36} {row['us']:9.1f} {row['GB/s']:7.0f} "
                    f"{row['pct_copy']:5.1f}%")
            if "best_config" in row:
                line += f"   {row['best_config']} / {row['best_pct_copy']:.1f}%"
            print(line, flush=True)
            if row["pct_copy"] < 80:
                for note in row["tuner"]:
                    print(f"    {note[:600]}", flush=True)
            table.append(line)
    result = {"device": torch.cuda.get_device_name(), "target": str(target),
              "torch": torch.__version__, "triton": triton.__version__,
              "host": platform.node(), "copy_GB/s": copy_gbs, "cases": rows}
    below = [r for r in rows if r["pct_copy"] < 80]
    wrong = [r for r in rows if not r["correct"]]
    summary = f"{len(rows) - len(below)}/{len(rows)} kernels at >= 80% of copy bandwidth"
    summary += f"; {len(wrong)} case(s) WRONG vs eager" if wrong else "; all match eager"
    with open(args.out, "w") as f:
        if args.out.endswith(".json"):
            json.dump(result, f, indent=2)
        else:  # a readable table, then the same results as JSON
            f.write(f"{result['device']}  copy_ {copy_gbs:.0f} GB/s\n" + "\n".join(table))
            f.write(f"\n{summary}\n\n" + json.dumps(result, indent=2) + "\n")
    print(f"\n{summary}; {time.perf_counter() - start:.0f} s; results in {args.out}")


if __name__ == "__main__":
    main()
