"""The gated delta kernel's forms on the interpret target over random shapes (issue 14).

Why: a template change (a new form, a reordered load) must stay right on shapes the
tests do not pin: key and value dims that are not powers of two (masked lanes), value
heads a multiple of the key heads, T of one step to several padded chunks, packed
sequences, fp32 / bf16 / fp16. Each trial compiles the op's region, launches random
forced configs (and the default) and compares with the step-by-step recurrence in fp64.

Usage: PYTHONPATH=. python benchmarks/probes/gated_delta_interpret_sweep.py \\
           [--seed 0] [--trials 20] [--form 1]   (--form: only configs with that STAGED)
Prints one line a case and `cases N worst err/tol X`; exits 1 on any case over tolerance.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kiln  # noqa: E402
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


class Packed(torch.nn.Module):
    def forward(self, q, k, v, g, beta, state, cu):
        return gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                cu_seqlens=cu)


def trial(rng: random.Random, n: int, form: int | None) -> list[tuple[str, float]]:
    """One random shape: (description, error / tolerance) for each config run."""
    K, V = rng.choice([8, 16, 24, 48, 64, 80, 128]), rng.choice([8, 16, 40, 64, 96])
    H = rng.choice([1, 2])
    HV, T, B = H * rng.choice([1, 2]), rng.choice([1, 5, 33, 64, 70, 97]), rng.choice([1, 2])
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    packed = T > 3 and rng.random() < 0.3
    q, k, v, g, beta = inputs(1 if packed else B, T, H, HV, K, V, seed=n)
    bounds = [0, *sorted(rng.sample(range(1, T), 2)), T] if packed else None
    state = torch.randn(3 if packed else B, HV, K, V) * 0.5
    args = (q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), state)
    if packed:
        args += (torch.tensor(bounds, dtype=torch.int32),)
    plan = kiln.compile(Packed() if packed else Delta(), args, compile_to="dispatch")
    (region,) = [r for r in plan.regions if r.kind == RegionKind.EXTERN]
    spec = gated_delta.generate(region, plan, get_target("interpret"))
    small = [c for c in spec.configs if c["CHUNK"] <= 32 and c.num_warps == 4
             and c.num_stages == 1 and (form is None or dict(c.params).get("STAGED") == form)]
    configs = rng.sample(small, min(2, len(small))) + ([] if form is not None else [spec.default])
    floats = [a.float() for a in args[:5]]
    spans = list(zip(bounds[:-1], bounds[1:])) if packed else [(0, T)]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    rows = []
    for config in configs:
        outs = {o: torch.full(tuple(plan.values[o].shape), float("nan"),
                              dtype=plan.values[o].dtype) for o in region.outputs}
        TritonKernel(region, spec, config, interpret=True).run(
            dict(zip(region.inputs, args)), outs, {})
        o, final = sorted(outs.values(), key=lambda t: t.dim() != 4)
        errs = []
        for i, (a, b) in enumerate(spans):
            rows_of = slice(i, i + 1) if packed else slice(None)
            ref_o, ref_s = reference(*[x[:, a:b] for x in floats], K ** -0.5, state[rows_of])
            errs += [rel_err(o[:, a:b].float(), ref_o), rel_err(final[rows_of].float(), ref_s)]
        what = (f"B={B} T={T} H={H} HV={HV} K={K} V={V} {str(dtype)[6:]} packed={packed} "
                f"[{config}]")
        rows.append((what, max(errs) / tol))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--form", type=int, choices=[0, 1], help="only this STAGED form")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    worst, cases = 0.0, 0
    for n in range(a.trials):
        for what, ratio in trial(rng, n, a.form):
            cases, worst = cases + 1, max(worst, ratio)
            print(f"{what} err/tol {ratio:.3f}{'  FAIL' if not ratio <= 1 else ''}", flush=True)
    print(f"cases {cases} worst err/tol {worst:.3f}")
    sys.exit(0 if worst <= 1 else 1)


if __name__ == "__main__":
    main()
