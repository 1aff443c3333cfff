"""Generated pointwise and reduction kernels vs the GPU's copy bandwidth.

For each case kiln compiles a small module for the local GPU (target "cuda") and times
its generated kernel alone (triton.testing.do_bench, median, L2 flushed between runs)
on large inputs. Bandwidth counts every byte the kernel must move: each input tensor
read once, each output written once. The reference is torch's device-to-device copy_
of a 1 GiB buffer (bytes read + written). Goal: >= 80% of copy bandwidth.

    PYTHONPATH=. python benchmarks/bandwidth.py --out bandwidth.txt [--sweep]

(--out: a .json path gets JSON only; any other path, the table followed by the JSON.)

Kernels run at the config kiln's autotuner picks (--tune fast, the default; --tune none
for the heuristic default). --sweep also times up to --max-configs candidate configs
(compiled here) and reports the best. Runs on torch 2.11 / triton 3.6 and later.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import kiln
from kiln.codegen.triton.compiler import compile_binary
from kiln.codegen.triton.kernel import TritonKernel
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
        for cols in (4096, 32000):  # 32000: looped rows (online softmax)
            out.append((f"softmax rows of {cols}", lambda m, x: torch.softmax(x, -1),
                        [((1 << 26) // cols, cols)], dt, {}))
    out.append(("sum over rows (dim -1)", lambda m, x: x.sum(-1), [(1 << 14, 4096)],
                torch.float32, {}))
    out.append(("sum over columns (dim 0)", lambda m, x: x.sum(0), [(4096, 1 << 14)],
                torch.float32, {}))
    return out


def _n(dt: torch.dtype) -> str:
    return {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dt]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def launcher(kernel: TritonKernel, inputs, outs, env, config=None, binary=None):
    """A zero-argument launch of `kernel` (its binary, args and grid fixed once)."""
    args, sizes = kernel._args(inputs, outs, env)
    config = config or kernel.config
    # the launcher takes every parameter, constexpr tunables included (as TritonKernel.run)
    args = args[: len(kernel.spec.args)] + [config[t] for t in kernel.spec.tunables]
    grid = kernel.spec.grid_for(sizes, config)
    fn = (binary or kernel.binary).kernel(kernel.spec, config)
    return lambda: fn[grid](*args)


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
    exe = kiln.compile(module, tuple(xs), target=target, options={"tune": args.tune})
    env = exe.program.bind(xs, exe.plan.user_inputs)
    rows = []
    for region in exe.plan.regions:
        kernel = exe.program.kplan.kernels[region.name]
        if not isinstance(kernel, TritonKernel):
            print(f"  {name}: region {region.name} runs extern: {region.notes}")
            continue
        inputs, outs = region_tensors(exe, region, xs, env)
        nbytes = moved_bytes(inputs, outs)
        ms = do_bench(launcher(kernel, inputs, outs, env), return_mode="median")
        gbs = nbytes / (ms * 1e-3) / 1e9
        row = {"case": name, "dtype": _n(dtype), "shape": [list(s) for s in shapes],
               "kernel": kernel.spec.name, "config": str(kernel.config), "us": ms * 1e3,
               "bytes": nbytes, "GB/s": gbs, "pct_copy": 100 * gbs / copy_gbs,
               "persistent": kernel.spec.meta.get("persistent")}
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
    ap.add_argument("--only", default=None, help="run cases whose name contains this")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bandwidth.py needs a CUDA GPU")
    names = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    dtypes = [names[d] for d in args.dtypes.split(",")]
    target = get_target("cuda")
    copy_gbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  target {target}  torch {torch.__version__}  "
          f"triton {triton.__version__}\ncopy_ bandwidth: {copy_gbs:.0f} GB/s (read + write)\n")
    head = f"{'case':28} {'dtype':5} {'kernel config':32} {'us':>9} {'GB/s':>7} {'%copy':>6}"
    print(head + ("   best config / %copy" if args.sweep else ""))
    rows, table = [], [head]
    for name, fn, shapes, dtype, weights in cases(dtypes):
        if args.only and args.only not in name:
            continue
        for row in run_case(name, fn, shapes, dtype, weights, copy_gbs, target, args):
            rows.append(row)
            line = (f"{row['case'][:28]:28} {row['dtype']:5} {row['config'][:32]:32} "
                    f"{row['us']:9.1f} {row['GB/s']:7.0f} {row['pct_copy']:5.1f}%")
            if "best_config" in row:
                line += f"   {row['best_config']} / {row['best_pct_copy']:.1f}%"
            print(line, flush=True)
            table.append(line)
    result = {"device": torch.cuda.get_device_name(), "target": str(target),
              "torch": torch.__version__, "triton": triton.__version__,
              "host": platform.node(), "copy_GB/s": copy_gbs, "cases": rows}
    below = [r for r in rows if r["pct_copy"] < 80]
    summary = f"{len(rows) - len(below)}/{len(rows)} kernels at >= 80% of copy bandwidth"
    with open(args.out, "w") as f:
        if args.out.endswith(".json"):
            json.dump(result, f, indent=2)
        else:  # a readable table, then the same results as JSON
            f.write(f"{result['device']}  copy_ {copy_gbs:.0f} GB/s\n" + "\n".join(table))
            f.write(f"\n{summary}\n\n" + json.dumps(result, indent=2) + "\n")
    print(f"\n{summary}; results in {args.out}")


if __name__ == "__main__":
    main()
