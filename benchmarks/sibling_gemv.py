"""Sibling decode GEMVs in one kernel (kiln.dispatch.group_siblings) against one kernel
each, at Llama-3-8B's widths, fp16, B decode rows.

Per case, an RMSNorm then HF Llama's separate projections of the normed x:

- qkv:     q_proj (4096), k_proj (1024), v_proj (1024), the three products returned;
- gate_up: silu(gate_proj(h)) * up_proj(h), 14336 wide each.

Forms, each compiled by kiln for the GPU and replayed as a CUDA graph:

- grouped: kiln as it compiles (the siblings grouped: one launch; the tuner keeps the
           group only if it beats the siblings apart, the region notes say which);
- apart:   the same model with grouping switched off (a GEMV kernel per projection);
- fused:   (gate_up only) gpt-fast's layout, one concatenated w13 split by chunk: the
           same bytes in one product, what grouping aims to match (a fused wqkv's
           returned split views would add copy kernels, so qkv has no such row).

Compiled with the compile cache off: the forms share one captured program.

`apart - grouped` is what grouping saves per layer and case in a decode step. Errors
against eager fp32. Writes JSON to --out.

    PYTHONPATH=. python3 benchmarks/sibling_gemv.py --out sibling_gemv.json [--rows 1,4]

Smoke test anywhere: --small (widths / 64, the interpret target, no CUDA graphs).
"""

from __future__ import annotations

import argparse
import json
import platform
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from measure import rel_err, timed_ms

import kiln
from kiln.dispatch import group_siblings

WIDTHS = {"dim": 4096, "q": 4096, "kv": 1024, "ffn": 14336}


class Case(torch.nn.Module):
    def __init__(self, case: str, w: dict, fused: bool):
        super().__init__()
        self.case, self.fused = case, fused
        self.norm = torch.nn.RMSNorm(w["dim"], eps=1e-5)
        outs = [w["q"], w["kv"], w["kv"]] if case == "qkv" else [w["ffn"], w["ffn"]]
        self.outs = outs
        if fused:
            self.proj = torch.nn.Linear(w["dim"], sum(outs), bias=False)
        else:
            self.projs = torch.nn.ModuleList(torch.nn.Linear(w["dim"], n, bias=False)
                                             for n in outs)

    def forward(self, x):
        h = self.norm(x)
        ys = (self.proj(h).split(self.outs, dim=-1) if self.fused
              else [p(h) for p in self.projs])
        return tuple(ys) if self.case == "qkv" else F.silu(ys[0]) * ys[1]


def _load_from(model: Case, base: Case) -> None:
    """`model`'s weights from `base` (fused: the siblings' weights concatenated)."""
    with torch.no_grad():
        model.norm.weight.copy_(base.norm.weight)
        if model.fused:
            model.proj.weight.copy_(torch.cat([p.weight for p in base.projs]))
        else:
            for p, q in zip(model.projs, base.projs):
                p.weight.copy_(q.weight)


@contextmanager
def grouping(on: bool):
    saved = group_siblings.group_siblings_of
    if not on:
        group_siblings.group_siblings_of = lambda plan: 0
    try:
        yield
    finally:
        group_siblings.group_siblings_of = saved


def run_case(name: str, rows: int, small: bool) -> dict:
    w = {k: v // 64 for k, v in WIDTHS.items()} if small else WIDTHS
    device, target = ("cpu", "interpret") if small else ("cuda", "cuda")
    x = torch.randn(rows, 1, w["dim"], device=device, dtype=torch.float16)
    torch.manual_seed(0)
    base = Case(name, w, False).to(device).eval()
    with torch.no_grad():
        base.norm.weight.normal_(1.0, 0.02)
        for p in base.projs:
            p.weight.normal_(0.0, 0.02)
        want = base(x.float())
    row: dict = {"case": name, "rows": rows, "dim": w["dim"]}
    forms = {"grouped": (False, True), "apart": (False, False)}
    if name == "gate_up":
        forms["fused"] = (True, False)
    for form, (fused, grouped) in forms.items():
        model = Case(name, w, fused).to(device).eval()
        _load_from(model, base)
        model = model.half()
        with grouping(grouped):
            exe = kiln.compile(model, (x,), target=target, options={"compile_cache": False})
        if not small:
            exe.cuda_graphs()
        row[f"{form}_kernels"] = len(exe.plan.regions)
        row[f"{form}_notes"] = [n for r in exe.plan.regions for n in r.notes
                                if n.startswith("siblings")]
        with torch.no_grad():
            got = exe(x)
            got = got if isinstance(got, tuple) else (got,)
            ref = want if isinstance(want, tuple) else (want,)
            row[f"{form}_err"] = max(rel_err(g.float(), r) for g, r in zip(got, ref))
            row[f"{form}_ms"] = timed_ms(lambda: exe(x), device)  # noqa: B023
    row["saved_us"] = round(1e3 * (row["apart_ms"] - row["grouped_ms"]), 2)
    if "fused_ms" in row:
        row["over_fused_us"] = round(1e3 * (row["grouped_ms"] - row["fused_ms"]), 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--cases", default="qkv,gate_up")
    ap.add_argument("--small", action="store_true", help="smoke test: interpret target")
    args = ap.parse_args()
    results = []
    for name in args.cases.split(","):
        for r in (int(r) for r in args.rows.split(",") if r):
            res = run_case(name, r, args.small)
            print(json.dumps(res))
            results.append(res)
    device = "interpret" if args.small else torch.cuda.get_device_name()
    meta = {"device": device, "torch": torch.__version__,
            "python": platform.python_version()}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
