"""Sibling decode GEMVs in one kernel (kiln.dispatch.group_siblings, group_fp8_siblings)
against one kernel each, B decode rows.

Per case, an RMSNorm then separate projections of the normed x:

- qkv:        Llama-3-8B's q_proj (4096), k_proj (1024), v_proj (1024), fp16, the three
              products returned;
- gate_up:    silu(gate_proj(h)) * up_proj(h), 14336 wide each, fp16;
- fp8_qkv, fp8_gate_up: the same with the projections block-scaled fp8 (a Llama
              loaded with quantize="fp8"), bf16 activations;
- v3_q_kv_a:  DeepSeek-V3's q_a_proj (1536) and kv_a_proj_with_mqa (576) of hidden 7168,
              fp8, bf16, both returned;
- v3_dense_gate_up, v3_shared_gate_up: V3's dense MLP (18432) and shared expert (2048)
              gate / up, fp8, SiLU(gate) * up.

fp8 siblings group only at one token (the fp8 GEMV form's): those cases skip other
row counts.

Forms, each compiled by kiln for the GPU and replayed as a CUDA graph:

- grouped: kiln as it compiles (the siblings grouped: one launch; the tuner keeps the
           group only if it beats the siblings apart, the region notes say which and
           the tuner's times of both);
- apart:   the same model with grouping switched off (a GEMV kernel per projection,
           and for fp8 pairs the SiLU product a kernel of its own);
- fused:   (gate_up cases) gpt-fast's layout, one concatenated w13 split by chunk: the
           same bytes in one product, what grouping aims to match (a fused wqkv's
           returned split views would add copy kernels, so qkv has no such row; V3's
           kv_a width is no multiple of the fp8 weight's 128-row scale blocks).

Compiled with the compile cache off: the forms share one captured program.

`apart - grouped` is what grouping saves per layer and case in a decode step. Errors
against eager fp32 (fp16 cases) or against the same fp8 model run eagerly in bf16
(fp8 cases: only the compile's error). Writes JSON to --out.

    PYTHONPATH=. python3 benchmarks/sibling_gemv.py --out sibling_gemv.json [--rows 1,4]
    PYTHONPATH=. python3 benchmarks/sibling_gemv.py --out fp8.json --rows 1 \
        --cases v3_q_kv_a,v3_dense_gate_up,v3_shared_gate_up,fp8_qkv,fp8_gate_up

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
from kiln.dispatch import group_fp8_siblings, group_siblings
from kiln.dispatch.group_fp8_siblings import FP8_GEMV_MAX_M
from kiln.models.fp8 import Fp8Linear

WIDTHS = {"llama": {"dim": 4096, "q": 4096, "kv": 1024, "ffn": 14336},
          "v3": {"dim": 7168, "q_a": 1536, "kv_a": 576, "ffn": 18432, "shared": 2048}}
# case -> (model widths, its projections' widths, paired by SiLU(gate) * up, fp8)
CASES = {"qkv": ("llama", ["q", "kv", "kv"], False, False),
         "gate_up": ("llama", ["ffn", "ffn"], True, False),
         "fp8_qkv": ("llama", ["q", "kv", "kv"], False, True),
         "fp8_gate_up": ("llama", ["ffn", "ffn"], True, True),
         "v3_q_kv_a": ("v3", ["q_a", "kv_a"], False, True),
         "v3_dense_gate_up": ("v3", ["ffn", "ffn"], True, True),
         "v3_shared_gate_up": ("v3", ["shared", "shared"], True, True)}


class Case(torch.nn.Module):
    def __init__(self, case: str, w: dict, fused: bool):
        super().__init__()
        _, outs, self.pair, _ = CASES[case]
        self.fused = fused
        self.norm = torch.nn.RMSNorm(w["dim"], eps=1e-5)
        self.outs = outs = [w[o] for o in outs]
        if fused:
            self.proj = torch.nn.Linear(w["dim"], sum(outs), bias=False)
        else:
            self.projs = torch.nn.ModuleList(torch.nn.Linear(w["dim"], n, bias=False)
                                             for n in outs)

    def forward(self, x):
        h = self.norm(x)
        ys = (self.proj(h).split(self.outs, dim=-1) if self.fused
              else [p(h) for p in self.projs])
        return F.silu(ys[0]) * ys[1] if self.pair else tuple(ys)

    def to_fp8(self) -> Case:
        """Each projection block-scaled fp8 (kiln.models.fp8.Fp8Linear), in place."""
        if self.fused:
            self.proj = Fp8Linear.from_linear(self.proj)
        else:
            self.projs = torch.nn.ModuleList(Fp8Linear.from_linear(p) for p in self.projs)
        return self


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
    saved = group_siblings.group_siblings_of, group_fp8_siblings.group_fp8_siblings_of
    if not on:
        group_siblings.group_siblings_of = lambda plan: 0
        group_fp8_siblings.group_fp8_siblings_of = lambda plan: 0
    try:
        yield
    finally:
        group_siblings.group_siblings_of, group_fp8_siblings.group_fp8_siblings_of = saved


def run_case(name: str, rows: int, small: bool) -> dict:
    family, _, pair, fp8 = CASES[name]
    w = {k: v // 64 for k, v in WIDTHS[family].items()} if small else WIDTHS[family]
    device, target = ("cpu", "interpret") if small else ("cuda", "cuda")
    dtype = torch.bfloat16 if fp8 else torch.float16
    x = torch.randn(rows, 1, w["dim"], device=device, dtype=dtype)
    torch.manual_seed(0)
    base = Case(name, w, False).to(device).eval()
    with torch.no_grad():
        base.norm.weight.normal_(1.0, 0.02)
        for p in base.projs:
            p.weight.normal_(0.0, 0.02)
        want = base(x.float())
    row: dict = {"case": name, "rows": rows, "dim": w["dim"], "fp8": fp8}
    forms = {"grouped": (False, True), "apart": (False, False)}
    if pair and (not fp8 or all(n % 128 == 0 for n in base.outs)):  # fp8: whole blocks
        forms["fused"] = (True, False)
    for form, (fused, grouped) in forms.items():
        model = Case(name, w, fused).to(device).eval()
        _load_from(model, base)
        model = model.to(dtype)
        if fp8:
            model.to_fp8()
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
            ref = model(x) if fp8 else want  # fp8: the same module run eagerly
            ref = ref if isinstance(ref, tuple) else (ref,)
            row[f"{form}_err"] = max(rel_err(g.float(), r.float()) for g, r in zip(got, ref))
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
        if name not in CASES:
            ap.error(f"unknown case {name!r}: one of {', '.join(CASES)}")
        for r in (int(r) for r in args.rows.split(",") if r):
            if CASES[name][3] and r > FP8_GEMV_MAX_M:
                print(f"{name}: skipped at {r} rows (fp8 siblings group at "
                      f"{FP8_GEMV_MAX_M} token)")
                continue
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
