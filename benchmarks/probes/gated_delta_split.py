"""Where the gated delta rule kernel's time goes (issue 14): the whole kernel, its
preparers alone (walkers skip their chunk loop) and its walkers alone (preparers skip
their chunk), per config, with registers and spills, at the seed's shape on a GPU.
The one-pass form (STAGED = 0); for the staged form's roles see gated_delta_resources.py.

Usage: PYTHONPATH=. python benchmarks/probes/gated_delta_split.py [--T 8192]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import kiln
from kiln.codegen.build.source import load_kernel
from kiln.codegen.build.spec import Config
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.ops import gated_delta_rule

VARIANTS = {
    "whole": lambda s: s,
    "preparers": lambda s: s.replace("for c0 in range(bos, eos, CHUNK):",
                                     "for c0 in range(bos, bos, CHUNK):"),
    "walkers": lambda s: s.replace("if c0 < eos:", "if c0 < 0:"),
}


class Prefill(torch.nn.Module):
    def forward(self, q, k, v, g, beta):
        return gated_delta_rule(q, k, v, g, beta, output_final_state=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=36)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--configs", default="16:64:4:2,16:32:4:2,32:64:8:2,64:32:8:2,64:64:8:2",
                    help="CHUNK:BV:warps:stages,...")
    a = ap.parse_args()
    B, T, H, K = 1, a.T, a.heads, a.dim
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(B, T, H, K, device="cuda").bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda"))
    beta = torch.rand(B, T, H, device="cuda").bfloat16()
    args = (q, k, v, g, beta)
    exe = kiln.compile(Prefill(), args, target="cuda", options={"tune": "none"})
    (kernel,) = [x for x in exe.program.kplan.kernels.values()
                 if isinstance(x, TritonKernel) and x.spec.template == "gated_delta"]
    spec, region, plan = kernel.spec, kernel.region, exe.plan
    given = dict(zip(plan.user_inputs, args))
    inputs = {n: given[n] for n in region.inputs}
    outs = {o: torch.empty(tuple(int(d) for d in plan.values[o].shape),
                           dtype=plan.values[o].dtype, device="cuda") for o in region.outputs}
    print(f"T={T} H={H} K=V={K}  bf16")
    for text in a.configs.split(","):
        c, bv, w, st = (int(x) for x in text.split(":"))
        cfg = Config.make(w, st, CHUNK=c, BV=bv, STAGED=0)  # the one-pass form
        row = [f"[{cfg}]"]
        for name, edit in VARIANTS.items():
            fn = load_kernel(edit(spec.source), spec.name)
            tk = TritonKernel.__new__(TritonKernel)
            tk.spec, tk.config = spec, cfg
            tk._tunables = [cfg[t] for t in spec.tunables]
            args_, sizes = tk.launch_args(inputs, outs, {})
            grid = spec.grid_for(sizes, cfg)

            def launch(fn=fn, grid=grid, args_=args_, w=w, st=st):
                return fn[grid](*args_, num_warps=w, num_stages=st)

            ck = launch()
            torch.cuda.synchronize()
            ms = do_bench(launch, warmup=5, rep=40)
            regs = getattr(ck, "n_regs", "?")
            spills = getattr(ck, "n_spills", "?")
            row.append(f"{name} {ms:.3f} ms (regs {regs}, spills {spills})")
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
