"""Does every candidate config of the gated delta rule kernel run correctly on this GPU?
(issue 14: a tuning run died of an illegal memory access.) Each config runs in its own
process (a fault poisons the CUDA context), several at once, at a small shape with
the seed's head dims, against kiln's PyTorch form of the op in fp32.

Usage: PYTHONPATH=. python benchmarks/probes/gated_delta_configs.py [--T 200] [--jobs 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

import kiln
from kiln.codegen.build.source import load_kernel
from kiln.codegen.build.spec import Config
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.ops import gated_delta_rule


class Prefill(torch.nn.Module):
    def forward(self, q, k, v, g, beta, state):
        return gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)


def setup(T, H, K):
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, device="cuda"), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(1, T, H, K, device="cuda").bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, device="cuda"))
    beta = torch.rand(1, T, H, device="cuda").bfloat16()
    state = torch.randn(1, H, K, K, device="cuda")
    args = (q, k, v, g, beta, state)
    exe = kiln.compile(Prefill(), args, target="cuda", options={"tune": "none"})
    (kernel,) = [x for x in exe.program.kplan.kernels.values()
                 if isinstance(x, TritonKernel) and x.spec.template == "gated_delta"]
    return args, exe, kernel


def one(config_json: str, T: int, H: int, K: int) -> dict:
    args, exe, kernel = setup(T, H, K)
    cfg = Config.from_json(json.loads(config_json))
    spec, region, plan = kernel.spec, kernel.region, exe.plan
    given = dict(zip(plan.user_inputs, args))
    inputs = {n: given[n] for n in region.inputs}
    outs = {o: torch.empty(tuple(int(d) for d in plan.values[o].shape),
                           dtype=plan.values[o].dtype, device="cuda") for o in region.outputs}
    fn = load_kernel(spec.source, spec.name)
    tk = TritonKernel.__new__(TritonKernel)
    tk.spec, tk.config, tk._tunables = spec, cfg, [cfg[t] for t in spec.tunables]
    a, sizes = tk.launch_args(inputs, outs, {})
    for _ in range(3):  # repeated: the counters must come back to zero
        fn[spec.grid_for(sizes, cfg)](*a, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    torch.cuda.synchronize()
    ref_o, ref_s = gated_delta_rule(*(x.float() for x in args[:5]), initial_state=args[5],
                                    output_final_state=True)
    got = {o: outs[o] for o in region.outputs}
    errs = [((t.double() - r.double()).norm() / r.double().norm()).item()
            for t, r in zip(sorted(got.values(), key=lambda t: t.dim()), (ref_o, ref_s))]
    return {"config": str(cfg), "errors": errs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=200)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--K", type=int, default=256)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--only", help="run only configs whose text contains this")
    ap.add_argument("--one")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.T, a.H, a.K)))
        return
    _, _, kernel = setup(a.T, a.H, a.K)

    def run(cfg):
        p = subprocess.run([sys.executable, __file__, "--T", str(a.T), "--H", str(a.H),
                            "--K", str(a.K), "--one", json.dumps(cfg.to_json())],
                           capture_output=True, text=True, timeout=300)
        tail = (p.stdout.strip().splitlines() or [""])[-1]
        if p.returncode:
            err = [x for x in p.stderr.splitlines() if "Error" in x][-1:]
            return f"[{cfg}] FAILED rc={p.returncode}: {err}"
        return f"[{cfg}] {tail}"

    with ThreadPoolExecutor(a.jobs) as pool:
        todo = [c for c in kernel.spec.configs if not a.only or a.only in str(c)]
        for line in pool.map(run, todo):
            print(line, flush=True)


if __name__ == "__main__":
    main()
