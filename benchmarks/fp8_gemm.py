"""The block-scaled fp8 GEMM on the local GPU: kiln's generated kernel (kiln::fp8_linear,
templates/fp8_matmul) against torch's fp8 GEMMs and a bf16 matmul (issue 13).

y [M, N] = x [M, K] (bf16) @ w [N, K]^T, w float8_e4m3fn with fp32 scales per 128 x 128
block, x quantised per token in groups of 128 (inside kiln's kernel). Shapes: M in 1, 8,
128, 2048 by the (N, K) of DeepSeek-V3 (q_a 1536x7168, kv_a 576x7168, o 7168x16384,
shared expert gate/up 2048x7168 and down 7168x2048) and Llama-3-8B (4096x4096,
14336x4096, 4096x14336).

Timed per shape (milliseconds, TFLOP/s = 2 M N K / time):
- kiln: kiln.compile of a module holding one fp8 linear (static M, target cuda); the
  call includes kiln's per-call runtime overhead, which matters at M = 1;
- scaled_mm_rowwise: torch._scaled_mm with rowwise scales (x per token, w per output
  row: the recipe torch 2.5+ supports on sm_89/sm_90), x already in fp8: the GEMM alone;
- scaled_mm_rowwise+quant: the same plus quantising x in torch (amax, divide, cast),
  the work kiln's kernel fuses;
- scaled_mm_blockwise: torch.nn.functional.scaled_mm with DeepSeek's recipe (x 1x128,
  w 128x128 blocks), where this torch has it (2.9+, needs a recent cuBLAS); skipped
  with the reason otherwise;
- bf16: torch.matmul of bf16 x and a bf16 weight.
Ratios: kiln's TFLOP/s over each baseline's (the issue's target: >= 0.9 of
scaled_mm). kiln's output is checked against the op's PyTorch form (relative error).

Usage (GPU): PYTHONPATH=. python benchmarks/fp8_gemm.py --out $OUT/fp8_gemm.json
Smoke test anywhere: PYTHONPATH=. python benchmarks/fp8_gemm.py --device cpu --small
(the interpret target on one tiny shape; torch's fp8 GEMMs are skipped without CUDA).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import kiln
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.ops import fp8_linear, quantize_weight

DEEPSEEK = {"q_a": (1536, 7168), "kv_a": (576, 7168), "o": (7168, 16384),
            "shared_gate_up": (2048, 7168), "shared_down": (7168, 2048)}
LLAMA3_8B = {"llama_qo": (4096, 4096), "llama_gate_up": (14336, 4096),
             "llama_down": (4096, 14336)}
TOKENS = (1, 8, 128, 2048)
SMALL = {"small": (200, 300)}
SMALL_TOKENS = (1, 19)


class Linear(torch.nn.Module):
    def __init__(self, w, s):
        super().__init__()
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.register_buffer("weight_scale_inv", s)

    def forward(self, x):
        return fp8_linear(x, self.weight, self.weight_scale_inv)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn, device, reps: int = 5) -> float:
    """Median milliseconds of `fn`: triton's do_bench on a GPU, wall clock elsewhere."""
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def fp8_kernel(exe) -> str:
    """What kiln ran for the op: the generated kernel and its config, or why not."""
    for r in exe.program.plan.regions:
        if any(op.target == "kiln.fp8_linear.default" for op in r.ops):
            k = exe.program.kplan.kernels[r.name]
            if isinstance(k, TritonKernel):
                return f"triton [{k.config}]"
            return f"{k.kind}: {'; '.join(r.notes)}"
    return "missing"


def quantize_rows(x):
    """x [M, K] as fp8 with one scale per row (rowwise scaled_mm's activation recipe)."""
    s = x.float().abs().amax(1, keepdim=True).clamp(min=1e-10) / 448.0
    return (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


def scaled_mm_rowwise(w, ws):
    """(gemm(xq, xs), weight rows' scales): torch._scaled_mm with per-token x scales and
    per-row w scales; the weight is requantised per row from its dequantised value."""
    from kiln.ops.fp8_linear import dequantize_weight

    wr = dequantize_weight(w, ws)
    sw = wr.abs().amax(1, keepdim=True).clamp(min=1e-10) / 448.0
    wq = (wr / sw).to(torch.float8_e4m3fn)
    wt, sw_t = wq.t(), sw.t().contiguous()  # [K, N] column-major, [1, N]

    def gemm(xq, xs):
        return torch._scaled_mm(xq, wt, scale_a=xs, scale_b=sw_t, out_dtype=torch.bfloat16)

    return gemm


def scaled_mm_blockwise(w, ws):
    """DeepSeek's recipe through torch.nn.functional.scaled_mm, or raises saying why not."""
    import torch.nn.functional as F

    if not hasattr(F, "scaled_mm"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm")
    st = F.ScalingType
    wt = w.t()  # [K, N] column-major

    def gemm(x):
        M, K = x.shape
        pad = -K % 128
        xp = torch.nn.functional.pad(x, (0, 0, 0, -M % 4))  # cuBLAS: tokens a multiple of 4
        g = torch.nn.functional.pad(xp.float(), (0, pad)).view(xp.shape[0], -1, 128)
        xs = g.abs().amax(-1).clamp(min=1e-10) / 448.0  # [M, K / 128]
        xq = (g / xs[..., None]).to(torch.float8_e4m3fn).view(xp.shape[0], -1)[:, :K]
        # the 1x128 scales outer-dim-major (column-major [M, K / 128]), the weight's
        # [K / 128, N / 128]: the layouts torch's own blockwise callers pass
        return F.scaled_mm(xq, wt, xs.t().contiguous().t(), st.BlockWise1x128, ws.t(),
                           st.BlockWise128x128, output_dtype=torch.bfloat16)[:M]

    return gemm


def run_shape(name, N, K, M, device, target, options, results):
    gen = torch.Generator().manual_seed(0)
    w_real = torch.randn(N, K, generator=gen) * 0.02
    w, ws = (t.to(device) for t in quantize_weight(w_real))
    x = torch.randn(M, K, generator=gen).to(device=device, dtype=torch.bfloat16)
    flops = 2 * M * N * K
    row = {"shape": name, "M": M, "N": N, "K": K}

    def record(key, fn):
        try:
            ms = timed_ms(fn, device)
            row[key] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
        except Exception as e:  # a baseline this torch / GPU lacks: say why, go on
            row[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}

    model = Linear(w, ws)
    t0 = time.perf_counter()
    exe = kiln.compile(model, (x,), target=target, options=options)
    y = exe(x)
    sync(device)
    row["compile_s"] = time.perf_counter() - t0
    row["kiln_kernel"] = fp8_kernel(exe)
    row["kiln_rel_err"] = rel_err(y.float(), model(x).float())  # the op's PyTorch form
    record("kiln", lambda: exe(x))
    if device == "cuda":
        gemm = scaled_mm_rowwise(w, ws)
        xq, xs = quantize_rows(x)
        record("scaled_mm_rowwise", lambda: gemm(xq, xs))
        record("scaled_mm_rowwise+quant", lambda: gemm(*quantize_rows(x)))
        try:
            block = scaled_mm_blockwise(w, ws)
            block(x)
            record("scaled_mm_blockwise", lambda: block(x))
        except Exception as e:
            row["scaled_mm_blockwise"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        wb = w.to(torch.bfloat16)  # the same shape in bf16: the 16-bit GEMM's time
        record("bf16", lambda: torch.matmul(x, wb.t()))
    kiln_tf = row["kiln"].get("tflops")
    for key in ("scaled_mm_rowwise", "scaled_mm_rowwise+quant", "scaled_mm_blockwise", "bf16"):
        other = row.get(key, {}).get("tflops")
        if kiln_tf and other:
            row[f"ratio_vs_{key}"] = kiln_tf / other
    results["rows"].append(row)
    print(_line(row), flush=True)


def _line(row) -> str:
    def fig(key):
        r = row.get(key)
        if r is None:
            return "-"
        return "err" if "error" in r else f"{r['ms']:.3f} ms {r['tflops']:.1f} TF"

    head = f"{row['shape']:>15} M={row['M']:<5} N={row['N']:<6} K={row['K']:<6}"
    kiln_part = f"kiln {fig('kiln')} (err {row['kiln_rel_err']:.1e}, {row['kiln_kernel']})"
    ratio = row.get("ratio_vs_scaled_mm_rowwise")
    if ratio is None:
        return f"{head} {kiln_part}"
    return (f"{head} {kiln_part} | rowwise {fig('scaled_mm_rowwise')} | +quant "
            f"{fig('scaled_mm_rowwise+quant')} | blockwise {fig('scaled_mm_blockwise')} | "
            f"bf16 {fig('bf16')} | kiln/rowwise {ratio:.2f}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="one tiny shape (smoke test)")
    ap.add_argument("--shapes", choices=["all", "deepseek", "llama"], default="all")
    ap.add_argument("--tokens", type=int, nargs="*", help=f"M values (default {TOKENS})")
    ap.add_argument("--tune", default=None, choices=["none", "fast", "full"],
                    help="kiln's autotuning (default: kiln's own default)")
    return ap.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    if a.small:
        shapes, tokens = SMALL, a.tokens or SMALL_TOKENS
    else:
        shapes = {"all": {**DEEPSEEK, **LLAMA3_8B}, "deepseek": DEEPSEEK,
                  "llama": LLAMA3_8B}[a.shapes]
        tokens = a.tokens or TOKENS
    target = "cuda" if a.device == "cuda" else "interpret"
    options = {"tune": a.tune} if a.tune else {}
    results = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
               "torch": torch.__version__, "target": target, "options": options, "rows": []}
    for name, (N, K) in shapes.items():
        for M in tokens:
            run_shape(name, N, K, M, a.device, target, options, results)
            if a.out:  # after every shape: a crash keeps what was measured
                with open(a.out, "w") as f:
                    json.dump(results, f, indent=2, default=str)
    return results


if __name__ == "__main__":
    main()
