"""Compile-only (no GPU): registers, spilled words and shared memory of the prefill
attention kernel kiln generates for each of prefill_attention.py's modules, at the
template's default config (tune none), for sm_90.

Why: the attention's resources decide its speed before a GPU is lent: 255 registers
with spills (the mask loops, a prologue in the key loop) ran 10-16x slower or a few
percent slower, and what removes them can be checked here. Use the GPU image's Triton
(3.6) for its numbers: 3.9's register counts differ.

    PYTHONPATH=. python benchmarks/probes/attention_resources.py [--lengths 2048]
"""

from __future__ import annotations

import argparse
import json

import torch
from prefill_attention import (  # this folder's: run as a script
    CACHE,
    HEADS,
    KV_HEADS,
    CausalExact,
    D,
    MaskedCache,
    MaskedCacheRope,
    PrefixCache,
    SelfRope,
)

import kiln
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.templates.attention import template
from kiln.ir.plan import RegionKind
from kiln.target import get_target

MODULES = {"masked_cache": MaskedCache, "prefix_cache": PrefixCache,
           "masked_cache_rope": MaskedCacheRope, "self_rope": SelfRope,
           "causal_exact": CausalExact}


def resources(cls, t: int, dtype: torch.dtype) -> dict:
    target = get_target("cuda:sm_90")
    kc, vc = (torch.randn(1, KV_HEADS, CACHE, D, dtype=dtype) for _ in range(2))
    ex = (torch.randn(1, HEADS, t, D, dtype=dtype), kc, vc, torch.arange(t))
    plan = kiln.compile(cls(), ex, target="cuda:sm_90", compile_to="dispatch",
                        options={"tune": "none"})
    (region,) = [r for r in plan.regions if r.kind == RegionKind.ATTENTION]
    spec = template.generate(region, plan, target)
    res = compile_binary(spec, spec.default, target).resources
    return {"registers": res.registers, "spills": res.spills, "shared": res.shared,
            "config": str(spec.default), "mask_loops": "if not plain" in spec.source,
            "key_bounds": region.key_bounds is not None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048])
    ap.add_argument("--modules", nargs="+", default=list(MODULES), choices=list(MODULES))
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for t in args.lengths:
        for name in args.modules:
            row = {"module": name, "t": t, **resources(MODULES[name], t, torch.float16)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
