"""kiln's topk kernel (codegen/templates/topk.py) against torch.topk at MoE routers'
shapes, inside CUDA graphs as decode runs them.

Per shape ([rows, width] top k, fp32 as routers score): R topks in one CUDA graph, for
torch (R torch.topk calls on one input: three kernels each) and for kiln (a module of R
topks of x + i: each its own kernel, the add fused as its prologue); a topk's cost is
(t(R) - t(1)) / (R - 1), so the graph launch and kiln's call overhead cancel. Checks
kiln's values and indices against torch.topk (distinct values: no ties). Writes JSON.

    PYTHONPATH=. python3 benchmarks/topk_routing.py --out topk.json [--rows 1,2,4,8]
        [--tune full]

Smoke test anywhere: --small (the interpret target, no graphs, R = 2).
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
from measure import timed_ms

import kiln

# (width, k, groups): DeepSeek-V3's experts top 8 and its groups' top 4, Qwen3-Next's
# 512 top 10, DeepSeek-V3's per-group top 2 ([rows, 8, 32])
SHAPES = [(256, 8, 1), (8, 4, 1), (512, 10, 1), (32, 2, 8)]


class Chain(torch.nn.Module):
    def __init__(self, repeats: int, k: int):
        super().__init__()
        self.repeats, self.k = repeats, k

    def forward(self, x):
        outs = []
        for i in range(self.repeats):
            values, indices = (x + float(i)).topk(self.k, dim=-1)
            outs += [values, indices]
        return tuple(outs)


def _torch_graph(x, k: int, repeats: int):
    torch.topk(x, k)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            torch.topk(x, k)
    return graph.replay


def _kiln(x, k: int, repeats: int, small: bool, tune: str = "none"):
    exe = kiln.compile(Chain(repeats, k), (x,), target="interpret" if small else "cuda",
                       options={"tune": tune})
    if not small:
        exe.cuda_graphs()
    kinds = [r.kind.value for r in exe.plan.regions]
    return exe, kinds


def run_case(rows: int, width: int, k: int, groups: int, repeats: int, small: bool,
             tune: str) -> dict:
    device = "cpu" if small else "cuda"
    shape = (rows, groups, width) if groups > 1 else (rows, width)
    n = torch.Size(shape).numel()
    x = (torch.randperm(n, device=device).float() / n).reshape(shape)  # distinct values
    row: dict = {"shape": list(shape), "k": k, "repeats": repeats}
    exe, kinds = _kiln(x, k, repeats, small, tune)
    row["kiln_regions"] = sorted(set(kinds))
    row["kiln_configs"] = sorted({str(getattr(k_, "config", "torch"))
                                  for k_ in exe.program.kplan.kernels.values()})
    got = exe(x)
    ok = True
    for i in range(repeats):
        want = torch.topk(x + float(i), k, dim=-1)
        ok &= torch.equal(got[2 * i], want.values) and torch.equal(got[2 * i + 1], want.indices)
    row["kiln_matches_torch"] = bool(ok)
    if small:
        return row
    one, _ = _kiln(x, k, 1, small, tune)
    t_kiln = timed_ms(lambda: exe(x), device)
    t_kiln1 = timed_ms(lambda: one(x), device)
    t_torch = timed_ms(_torch_graph(x, k, repeats), device)
    t_torch1 = timed_ms(_torch_graph(x, k, 1), device)
    row["torch_us"] = round(1e3 * (t_torch - t_torch1) / (repeats - 1), 2)
    row["kiln_us"] = round(1e3 * (t_kiln - t_kiln1) / (repeats - 1), 2)
    row["speedup"] = round(row["torch_us"] / max(row["kiln_us"], 1e-3), 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=32)
    ap.add_argument("--tune", default="none", choices=["none", "fast", "full"],
                    help="kiln's tuning (none: the heuristic config, as the slices run)")
    ap.add_argument("--small", action="store_true", help="smoke test: interpret target")
    args = ap.parse_args()
    repeats = 2 if args.small else args.repeats
    results = []
    for width, k, groups in SHAPES:
        for rows in [int(r) for r in args.rows.split(",") if r]:
            res = run_case(rows, width, k, groups, repeats, args.small, args.tune)
            print(json.dumps(res))
            results.append(res)
    device = "interpret" if args.small else torch.cuda.get_device_name()
    meta = {"device": device, "tune": args.tune, "torch": torch.__version__,
            "python": platform.python_version()}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
