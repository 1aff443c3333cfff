"""What tuning costs and what it buys, on the local GPU: one large fp16 add region.

Reports the cold tuning time (worker start-up included), the cached one (must do no
work), and the median time of the default config, the tuned winner and the extern
torch form. Usage: PYTHONPATH=. python benchmarks/autotune.py [--out FILE] [--mode full]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from kiln.codegen.autotune.timing import bench, example_buffers
from kiln.codegen.autotune.tuner import Tuner
from kiln.codegen.autotune.worker_pool import get_pool
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.spec import Config, KernelArg, KernelSpec
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.torch_kernel import TorchKernel
from kiln.ir.plan import DispatchPlan, Op, Ref, Region, RegionKind, Role, TensorValue
from kiln.ir.symbolic import Bounds, symbol
from kiln.target import get_target

SOURCE = '''import triton
import triton.language as tl


@triton.jit
def add(x_ptr, y_ptr, out_ptr, n, XBLOCK: tl.constexpr):
    offs = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask),
             mask=mask)
'''


def add_region(width: int, dtype: torch.dtype):
    shape = (symbol("s0"), width)
    values = {n: TensorValue(n, shape, dtype, role)
              for n, role in (("x", Role.INPUT), ("y", Role.INPUT), ("out", Role.OUTPUT))}
    region = Region("r0", RegionKind.POINTWISE,
                    [Op("out", "aten.add.Tensor", (Ref("x"), Ref("y")), {}, shape, dtype)],
                    ["x", "y"], ["out"])
    plan = DispatchPlan({"s0": Bounds(1, None)}, values, [region], ["x", "y"], ["out"])
    configs = [Config.make(w, 1, XBLOCK=b) for b in (256, 512, 1024, 2048, 4096)
               for w in (2, 4, 8)]
    spec = KernelSpec(
        "add", SOURCE,
        [KernelArg("x_ptr", "tensor", "x", dtype=dtype),
         KernelArg("y_ptr", "tensor", "y", dtype=dtype),
         KernelArg("out_ptr", "tensor", "out", dtype=dtype),
         KernelArg("n", "size", expr=symbol("s0") * width)],
        ["XBLOCK"], ("cdiv(n, XBLOCK)",), configs, Config.make(4, 1, XBLOCK=256),
        "pointwise")
    return region, plan, spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--mode", default="full", choices=["fast", "full"])
    args = ap.parse_args()
    os.environ.setdefault("KILN_CACHE_DIR", tempfile.mkdtemp(prefix="kiln-bench-cache-"))
    target = get_target("cuda")
    env = {"s0": 1 << 22}
    region, plan, spec = add_region(64, torch.float16)
    lines = [f"device {torch.cuda.get_device_name()} target {target} mode {args.mode} "
             f"elements {env['s0'] * 64}"]

    t0 = time.perf_counter()
    kernel = Tuner(target, args.mode, example_env=env).choose(region, spec, plan)
    cold = time.perf_counter() - t0
    sent = get_pool().jobs_sent
    t0 = time.perf_counter()
    Tuner(target, args.mode, example_env=env).choose(region, spec, plan)
    cached = time.perf_counter() - t0
    lines.append(f"tune cold {cold:.2f} s ({sent} compiles in workers), cached {cached:.3f} s "
                 f"({get_pool().jobs_sent - sent} compiles)")
    lines.append(f"choice: {region.notes[-2]}")

    inputs, outs = example_buffers(region, plan, env, "cuda")
    default = TritonKernel(region, spec, spec.default,
                           compile_binary(spec, spec.default, target))
    nbytes = 3 * env["s0"] * 64 * 2
    for name, k in (("default", default), ("tuned", kernel),
                    ("extern", TorchKernel(region, "cuda"))):
        ms = bench(k, inputs, outs, env)
        lines.append(f"{name:8s} {ms:.4f} ms  {nbytes / ms / 1e6:.0f} GB/s")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
