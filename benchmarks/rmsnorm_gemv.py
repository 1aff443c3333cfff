"""An RMSNorm (or, `--norm layer`, a LayerNorm) folded into the decode GEMV after it
(kiln.dispatch.fold_rmsnorm) against the same norm as a kernel of its own, at
Llama-3-8B's widths (`--widths` another model's).

Per case (the projections that read a norm: wqkv, w13 with SwiGLU, the LM head), fp16,
B decode rows, each module compiled by kiln for the GPU and replayed as a CUDA graph:

- folded:   RMSNorm -> projection; kiln folds the norm into the GEMV (one kernel);
- apart:    the same, but the normed value is also returned, so it stays a reduction
            kernel of its own before the GEMV (what decode ran before the fold);
- gemv:     the projection alone, no norm (the floor the folded kernel aims at).

`apart - folded` is what one fold saves in a decode step (a kernel and its gap in the
graph); `folded - gemv` what the folded norm costs inside the GEMV. Errors against
eager fp32. Writes JSON to --out.

    PYTHONPATH=. python3 benchmarks/rmsnorm_gemv.py --out rmsnorm_gemv.json [--rows 1,4]
    PYTHONPATH=. python3 benchmarks/rmsnorm_gemv.py --norm layer --widths stablelm-2-1.6b ...

Smoke test anywhere: --small (widths / 64, the interpret target, no CUDA graphs).
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F
from measure import rel_err, timed_ms

import kiln

MODEL_WIDTHS = {
    "llama3-8b": {"dim": 4096, "ffn": 14336, "vocab": 128256, "qkv": 6144},
    # LayerNorm families (their projections have biases: --norm layer adds them)
    "stablelm-2-1.6b": {"dim": 2048, "ffn": 5632, "vocab": 100352, "qkv": 6144},
    "gpt2-medium": {"dim": 1024, "ffn": 4096, "vocab": 50257, "qkv": 3072},
    "starcoder2-3b": {"dim": 3072, "ffn": 12288, "vocab": 49152, "qkv": 3584},
}
WIDTHS = MODEL_WIDTHS["llama3-8b"]


class Case(torch.nn.Module):
    def __init__(self, dim: int, out: int, swiglu: bool, norm: bool, keep_normed: bool,
                 layer: bool = False):
        super().__init__()
        if norm:
            self.norm = (torch.nn.LayerNorm(dim, eps=1e-5) if layer
                         else torch.nn.RMSNorm(dim, eps=1e-5))
        else:
            self.norm = None
        self.proj = torch.nn.Linear(dim, out, bias=layer)
        self.swiglu, self.keep_normed = swiglu, keep_normed
        with torch.no_grad():
            self.proj.weight.normal_(0.0, 0.02)
            if layer:
                self.proj.bias.normal_(0.0, 0.02)
            if self.norm is not None:
                self.norm.weight.normal_(1.0, 0.02)
                if layer:
                    self.norm.bias.normal_(0.0, 0.02)

    def forward(self, x):
        h = self.norm(x) if self.norm is not None else x
        y = self.proj(h)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        return (y, h) if self.keep_normed else y


CASES = {"wqkv": ("qkv", False), "w13_swiglu": ("ffn", True), "lm_head": ("vocab", False)}


def run_case(name: str, rows: int, small: bool, layer: bool = False,
             widths: dict = WIDTHS) -> dict:
    w = {k: v // 64 for k, v in widths.items()} if small else widths
    device, target = ("cpu", "interpret") if small else ("cuda", "cuda")
    width, swiglu = CASES[name]
    dim, out = w["dim"], w[width] * (2 if swiglu else 1)
    # a LayerNorm's input off zero mean, as a residual stream may be
    x = torch.randn(rows, 1, dim, device=device, dtype=torch.float16) + (0.5 if layer else 0)
    row: dict = {"case": name, "rows": rows, "dim": dim, "out": out,
                 "norm": "layer" if layer else "rms"}
    torch.manual_seed(0)
    base = Case(dim, out, swiglu, True, False, layer).to(device).half().eval()
    ref = Case(dim, out, swiglu, True, False, layer).to(device).float().eval()
    ref.load_state_dict(base.state_dict())
    with torch.no_grad():
        want = ref(x.float())
    for form, (norm, keep) in {"folded": (True, False), "apart": (True, True),
                               "gemv": (False, False)}.items():
        model = Case(dim, out, swiglu, norm, keep, layer).to(device).half().eval()
        model.load_state_dict(base.state_dict(), strict=False)
        exe = kiln.compile(model, (x,), target=target)
        if not small:
            exe.cuda_graphs()
        notes = [n for r in exe.plan.regions for n in r.notes if n.startswith("prologue:")]
        row[f"{form}_kernels"] = len(exe.plan.regions)
        row[f"{form}_folded"] = bool(notes)
        with torch.no_grad():
            got = exe(x)
            got = got[0] if isinstance(got, tuple) else got
            if norm:
                row[f"{form}_err"] = rel_err(got.float(), want)
            row[f"{form}_ms"] = timed_ms(lambda: exe(x), device)  # noqa: B023
    row["saved_us"] = round(1e3 * (row["apart_ms"] - row["folded_ms"]), 2)
    row["norm_cost_us"] = round(1e3 * (row["folded_ms"] - row["gemv_ms"]), 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--small", action="store_true", help="smoke test: interpret target")
    ap.add_argument("--norm", choices=["rms", "layer"], default="rms")
    ap.add_argument("--widths", choices=list(MODEL_WIDTHS), default="llama3-8b")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",") if r]
    results = []
    for name in args.cases.split(","):
        for r in rows:
            res = run_case(name, r, args.small, args.norm == "layer",
                           MODEL_WIDTHS[args.widths])
            print(json.dumps(res))
            results.append(res)
    device = "interpret" if args.small else torch.cuda.get_device_name()
    meta = {"device": device, "torch": torch.__version__,
            "python": platform.python_version(), "norm": args.norm, "widths": args.widths}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
