"""One forced config of the chunked gated delta kernel, launched once on the GPU (issue 14).

Why: the staged form's 16-bit dots on 8+ warps at value blocks <= 32 faulted with an
illegal address on an H200 (template._faults_staged keeps them out of the config space).
This runs one such config (outside the space) at the GPU test's shape (K = V = 128,
bf16, T = 157, two batch rows, 4 value heads over 2 key heads) so that a fault can be
located under compute-sanitizer; a config that runs prints its error against fp64.

    PYTHONPATH=. python benchmarks/probes/gated_delta_fault.py 64:32:8:2:1 [K = V, 128]
    compute-sanitizer --tool memcheck --kernel-name kns=gated_delta \\
        python benchmarks/probes/gated_delta_fault.py 64:32:8:2:1
(CHUNK:BV:warps:stages:STAGED)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kiln  # noqa: E402
from kiln.codegen.build.compiler import compile_binary  # noqa: E402
from kiln.codegen.build.spec import Config  # noqa: E402
from kiln.codegen.build.triton_kernel import TritonKernel  # noqa: E402
from kiln.codegen.templates.gated_delta import template as gated_delta  # noqa: E402
from kiln.ir.plan import RegionKind  # noqa: E402
from kiln.ops import gated_delta_rule  # noqa: E402
from kiln.target import get_target  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.ops.test_gated_delta_rule import inputs, reference  # noqa: E402


class Delta(torch.nn.Module):
    def forward(self, q, k, v, g, beta, state):
        return gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)


def main():
    chunk, bv, warps, stages, staged = (int(x) for x in sys.argv[1].split(":"))
    K = V = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    H, HV = 2, 4
    q, k, v, g, beta = inputs(2, 157, H, HV, K, V, seed=3)
    state = torch.randn(2, HV, K, V)
    args = (q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), state)
    cuda = tuple(a.cuda() for a in args)
    plan = kiln.compile(Delta(), cuda, compile_to="dispatch")
    (region,) = [r for r in plan.regions if r.kind == RegionKind.EXTERN]
    target = get_target("cuda")
    spec = gated_delta.generate(region, plan, target)
    config = Config.make(warps, stages, CHUNK=chunk, BV=bv, STAGED=staged)
    binary = compile_binary(spec, config, target)
    r = binary.resources
    print(f"{config}: {r.registers} registers, {r.spills} spilled, {r.shared} B shared",
          flush=True)
    kernel = TritonKernel(region, spec, config, binary)
    outs = {o: torch.full(tuple(int(d) for d in plan.values[o].shape), float("nan"),
                          dtype=plan.values[o].dtype, device="cuda") for o in region.outputs}
    kernel.run(dict(zip(region.inputs, cuda)), outs, {})
    torch.cuda.synchronize()
    o, final = sorted(outs.values(), key=lambda t: t.dim() != args[0].dim())
    ref_o, ref_s = reference(*(a.float() for a in args[:5]), K ** -0.5, state)
    print(f"ran: o err {rel_err(o.float().cpu(), ref_o):.2e}, "
          f"state err {rel_err(final.float().cpu(), ref_s):.2e}", flush=True)


if __name__ == "__main__":
    main()
