"""Compile-only (no GPU): the gated delta rule kernel's sm_90 shared memory, registers and
spills per config, at the seed's shape or Qwen3-Next's (issue 14). `--roles` also
compiles each role alone (the others' branches cut from the source), to say which role
sets the launch's registers.

Usage: PYTHONPATH=. python benchmarks/probes/gated_delta_resources.py --shape seed \\
           --configs 64:32:8:2:1,32:64:4:2:0 [--dtype bfloat16] [--roles] [--out x.json]
(CHUNK:BV:warps:stages:STAGED, comma-separated)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time

import torch

import kiln
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.resources import estimate
from kiln.codegen.build.spec import Config
from kiln.codegen.templates.gated_delta import template as gated_delta
from kiln.ir.plan import RegionKind
from kiln.ops import gated_delta_rule
from kiln.target import get_target

SHAPES = {"seed": dict(H=36, HV=36, K=256, V=256),
          "qwen3next": dict(H=16, HV=32, K=128, V=128)}
_CUTS = {  # source edits that take one role's branch out of the kernel (a constant
    # condition: Triton compiles only the branch taken)
    "preparers": (r"if ticket < n_prep:", "if False:"),
    "walkers": (r"elif ticket < n_prep \+ n_walk:", "elif False:"),
    "outputs": (r"if STAGED:(\s+)part = ", r"if False:\1part = "),
}


def only(source: str, role: str) -> str:
    """The kernel's source with every role but `role` cut out."""
    for other, (pattern, repl) in _CUTS.items():
        if other != role:
            source, n = re.subn(pattern, repl, source)
            assert n == 1, (other, n)
    return source


def spec_at(H, HV, K, V, dtype):
    q, k = (torch.randn(1, 128, H, K, dtype=dtype) for _ in range(2))
    v = torch.randn(1, 128, HV, V, dtype=dtype)
    g, beta = -torch.rand(1, 128, HV), torch.rand(1, 128, HV, dtype=dtype)

    class Op(torch.nn.Module):
        def forward(self, q, k, v, g, beta):
            return gated_delta_rule(q, k, v, g, beta, output_final_state=True)

    dim = kiln.Dim("T", min=1, max=8192)
    plan = kiln.compile(Op(), (q, k, v, g, beta), compile_to="dispatch",
                        dynamic_shapes=({1: dim},) * 5)
    (region,) = [r for r in plan.regions if r.kind == RegionKind.EXTERN]
    return gated_delta.generate(region, plan, get_target("cuda:sm_90"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="seed", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--configs", default="64:32:8:2:1")
    ap.add_argument("--roles", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    target = get_target("cuda:sm_90")
    spec = spec_at(**SHAPES[a.shape], dtype=getattr(torch, a.dtype))
    rows = []
    for text in a.configs.split(","):
        chunk, bv, warps, stages, form = (int(x) for x in text.split(":"))
        config = Config.make(warps, stages, CHUNK=chunk, BV=bv, STAGED=form)
        variants = {"whole": spec.source}
        if a.roles and form:
            variants.update({r: only(spec.source, r) for r in _CUTS})
        for role, source in variants.items():
            t0 = time.perf_counter()
            try:
                res = compile_binary(dataclasses.replace(spec, source=source), config,
                                     target).resources
                row = {"shared": res.shared, "registers": res.registers,
                       "spills": res.spills}
            except Exception as e:  # report it and go on with the next
                row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            row.update(config=str(config), role=role, in_space=config in spec.configs,
                       compile_s=round(time.perf_counter() - t0, 1),
                       estimated_shared=estimate(spec, config, target).shared)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"shape": a.shape, "dtype": a.dtype, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
