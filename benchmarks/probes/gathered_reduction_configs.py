"""Probe: the gathered experts' decode reductions at forced tile sizes (issue 14: in the
Qwen3-Next slice the gathered gate/up product ran 14.4 us for 11.1 us of bytes and the
down product 9.5 for 5.5, every time at the reduction template's default persistent tile
of ~2K elements over 4 warps; tune fast kept it).

The probe's module is gathered_down.py's `split` form (dim 2048, I 512, 10 of 512
experts, bf16, batch 1). Each variant patches the persistent form's default to XBLOCK =
TILE / RBLOCK rows over TILE / PER_WARP warps, compiles with tune none (no compile
cache), and times every kernel by the profiler over 8 calls of fresh experts a
replay of one CUDA graph. Run from the repo root:
PYTHONPATH=.:benchmarks/probes python benchmarks/probes/gathered_reduction_configs.py
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from gathered_down import CALLS, DIM, E, Gathered, K
from torch.profiler import ProfilerActivity, profile

import kiln
from kiln.codegen.build.spec import Config
from kiln.codegen.templates.reduction import row_kernel

TILES = (1024, 2048, 4096, 8192, 16384)
PER_WARP = (256, 512, 1024)


def forcing(tile: int, per_warp: int):
    """reduction_configs with the persistent default over contiguous rows replaced by
    (tile, per_warp)."""
    original = row_kernel.reduction_configs

    def forced(form, rbound, outer_bound, innermost, *args, **kw):
        configs, default = original(form, rbound, outer_bound, innermost, *args, **kw)
        if form != "persistent" or not innermost:  # the experts' combine keeps its own
            return configs, default
        rb = default["RBLOCK"]
        xb = max(1, tile // rb)
        warps = max(1, min(32, xb * rb // per_warp))
        chosen = Config.make(warps, 1, XBLOCK=xb, RBLOCK=rb)
        return [chosen] + [c for c in configs if c != chosen], chosen
    return forced


def kernel_times(exe, calls) -> dict[str, float]:
    """us per call of each kernel name, from one CUDA graph of the calls."""
    for args in calls:
        exe(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in calls:
            exe(*args)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    replays = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.name.startswith("kiln_"):
            out[e.name] = out.get(e.name, 0.0) + e.time_range.elapsed_us() / (replays * len(calls))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="JSON of every variant's kernel times")
    a = ap.parse_args()
    os.environ["KILN_COMPILE_CACHE"] = "0"
    os.environ["KILN_CACHE_DIR"] = tempfile.mkdtemp()
    torch.manual_seed(0)
    model = Gathered("split").to(torch.bfloat16).cuda()
    gen = torch.Generator().manual_seed(1)
    calls = [(torch.randn(1, DIM, generator=gen).to(torch.bfloat16).cuda(),
              torch.randperm(E, generator=gen)[:K][None].cuda(),
              torch.rand(1, K, generator=gen).cuda()) for _ in range(CALLS)]
    with torch.no_grad():
        want = model(*calls[0]).float()
    results = {}
    original = row_kernel.reduction_configs
    for tile in TILES:
        for per_warp in PER_WARP:
            row_kernel.reduction_configs = forcing(tile, per_warp)
            try:
                exe = kiln.compile(model, calls[0], target="cuda", options={"tune": "none"})
            finally:
                row_kernel.reduction_configs = original
            with torch.no_grad():
                err = ((exe(*calls[0]).float() - want).norm() / want.norm()).item()
            times = kernel_times(exe, calls)
            total = sum(times.values())
            cells = "  ".join(f"{n[:40]} {t:6.2f}" for n, t in sorted(times.items()))
            print(f"tile {tile:5d} per warp {per_warp:4d}: {total:6.2f} us  err {err:.1e}  {cells}",
                  flush=True)
            chosen = [exe.program.kplan.kernels[r.name].describe().split("\n")[0]
                      for r in exe.plan.regions]
            print("    " + " | ".join(chosen), flush=True)
            results[f"{tile}/{per_warp}"] = {"total_us": total, "kernels": times, "err": err,
                                             "chosen": chosen}
            del exe
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
