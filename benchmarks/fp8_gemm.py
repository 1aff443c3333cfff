"""The block-scaled fp8 linear on the local GPU: kiln's generated kernels (kiln::fp8_linear,
templates/fp8_matmul) against torch's fp8 GEMMs and a bf16 matmul (issue 13).

y [M, N] = x [M, K] (bf16) @ w [N, K]^T, w float8_e4m3fn with fp32 scales per 128 x 128
block, x quantised per token in groups of 128. Shapes: M in 1, 8, 128, 2048 by the (N, K)
of DeepSeek-V3 (q_a 1536x7168, kv_a 576x7168, o 7168x16384, shared expert gate/up
2048x7168 and down 7168x2048) and Llama-3-8B (4096x4096, 14336x4096, 4096x14336).
kiln compiles a module holding one fp8 linear (static M, target cuda): over 64 tokens
it runs two kernels, the quantisation of x and the block-scaled GEMM on fp8 x
(kiln.graph.split_fp8_linear); up to 64 one kernel quantises in its K loop.

Timed per shape (milliseconds, TFLOP/s = 2 M N K / time), each two ways: `ms` with
triton's do_bench (L2 flushed before each call; host overhead shows where the GPU
work is shorter than the call), `graph_ms` with do_bench_cudagraph (replayed CUDA
graphs: device time alone, L2 warm; the weights of the smaller shapes stay in L2):
- kiln: the compiled module's call (every kernel of the op; the quantisation too);
- kiln_gemm: kiln's GEMM kernel alone (the split form's kiln::fp8_scaled_mm on
  already quantised x, or the one-kernel form, which quantises inside);
- scaled_mm_rowwise: torch._scaled_mm with rowwise scales (x per token, w per output
  row: the recipe torch supports on sm_89/sm_90), x already in fp8: the GEMM alone;
- scaled_mm_rowwise+quant: the same plus quantising x in torch (amax, divide, cast);
- scaled_mm_blockwise: torch.nn.functional.scaled_mm with DeepSeek's recipe (x 1x128,
  w 128x128 blocks), where this torch has it (2.9+, needs a recent cuBLAS); skipped
  with the reason otherwise;
- bf16: torch.matmul of bf16 x and a bf16 weight.
Ratios (kiln's TFLOP/s over each baseline's; graph_ratio_* on graph_ms): the issue's
target is gemm_graph_ratio_vs_scaled_mm_rowwise >= 0.9 (GEMM against GEMM), and
graph_ratio_vs_scaled_mm_rowwise+quant is the whole op against torch's whole op.
kiln's output is checked against the op's PyTorch form (relative error).

--sweep times every config of the GEMM's config space on each split-form shape (the
kernel alone, under CUDA graphs, each checked against the op), to see what tuning
chooses from.

Usage (GPU): PYTHONPATH=. python benchmarks/fp8_gemm.py --out $OUT/fp8_gemm.json
Smoke test anywhere: PYTHONPATH=. python benchmarks/fp8_gemm.py --device cpu --small
(the interpret target on one tiny shape; torch's fp8 GEMMs are skipped without CUDA).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from measure import rel_err, sync, timed_ms

import kiln
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.ir.plan import Role
from kiln.ops import fp8_linear, quantize_weight
from kiln.ops.fp8_linear import quantize_activations
from kiln.settings import effective

FP8_OPS = ("kiln.fp8_linear.default", "kiln.fp8_quantize.default",
           "kiln.fp8_scaled_mm.default")
GEMM_OPS = ("kiln.fp8_linear.default", "kiln.fp8_scaled_mm.default")

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






def graph_ms(fn) -> float:
    """Median milliseconds of `fn` replayed as a CUDA graph: device time alone."""
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, return_mode="median"))




def fp8_regions(exe):
    """The op's regions and their kernels, in run order."""
    return [(r, exe.program.kplan.kernels[r.name]) for r in exe.program.plan.regions
            if any(op.target in FP8_OPS for op in r.ops)]


def fp8_kernel(exe) -> str:
    """What kiln ran for the op: each generated kernel and its config, or why not."""
    parts = []
    for r, k in fp8_regions(exe):
        op = r.anchor().target.split(".")[1]
        if isinstance(k, TritonKernel):
            parts.append(f"{op} triton [{k.config}]")
        else:
            parts.append(f"{op} {k.kind}: {'; '.join(r.notes)}")
    return " + ".join(parts) or "missing"


def region_inputs(exe, region, x) -> dict:
    """The values `region` reads, for running its kernel alone: x, the module's
    weights, and quantised x (made by the op's PyTorch form: the same bits)."""
    plan = exe.program.plan
    xq, xs = quantize_activations(x)
    temps = {}
    for r in plan.regions:
        for op in r.ops:
            if op.target == "getitem" and op.name in region.inputs:
                temps[op.name] = (xq, xs)[op.args[1]]
    out = {}
    for v in region.inputs:
        value = plan.values[v]
        if value.role == Role.INPUT:
            out[v] = x
        elif value.role in (Role.WEIGHT, Role.STATE):
            out[v] = exe.state[value.target]
        else:
            out[v] = temps[v]
    return out


def region_outputs(exe, region, device) -> dict:
    plan = exe.program.plan
    return {o: torch.empty(tuple(plan.values[o].shape), dtype=plan.values[o].dtype,
                           device=device) for o in region.outputs}


def gemm_region(exe):
    """(region, kernel) of the op's GEMM: kiln::fp8_scaled_mm, or the one-kernel form."""
    for r, k in fp8_regions(exe):
        if r.anchor().target in GEMM_OPS:
            return r, k
    return None, None


def time_gemm(exe, x, device, kernel=None):
    """(ms, output) of the GEMM's kernel alone (`kernel`: another config of it): CUDA
    graph replays on a GPU, wall clock elsewhere."""
    region, own = gemm_region(exe)
    kernel = kernel or own
    inputs, outs = region_inputs(exe, region, x), region_outputs(exe, region, device)

    def run():
        kernel.run(inputs, outs, {})

    ms = graph_ms(run) if device == "cuda" else timed_ms(run, device)
    return ms, outs[region.outputs[0]]


def sweep(exe, x, want, flops, device) -> list[dict]:
    """Every config of the split form's GEMM, timed alone and checked."""
    region, kernel = gemm_region(exe)
    if not isinstance(kernel, TritonKernel) or "scaled_mm" not in region.anchor().target:
        return []
    target, rows = exe.program.kplan.target, []
    for config in kernel.spec.configs:
        row = {"config": str(config)}
        try:
            if target.backend == "interpret":  # the smoke test: the same path, no binary
                binary, k = None, TritonKernel(region, kernel.spec, config, interpret=True)
            else:
                binary = compile_binary(kernel.spec, config, target)
                k = TritonKernel(region, kernel.spec, config, binary)
            ms, out = time_gemm(exe, x, device, k)
            row.update(graph_ms=ms, tflops=flops / (ms * 1e-3) / 1e12,
                       rel_err=rel_err(out.float(), want.float()))
            if binary is not None:
                row.update(registers=binary.resources.registers,
                           shared=binary.resources.shared)
        except Exception as e:  # a config that fails here is the tuner's to quarantine
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(f"    sweep {row}", flush=True)
    return rows


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


def run_shape(name, N, K, M, device, target, options, results, do_sweep=False):
    gen = torch.Generator().manual_seed(0)
    w_real = torch.randn(N, K, generator=gen) * 0.02
    w, ws = (t.to(device) for t in quantize_weight(w_real))
    x = torch.randn(M, K, generator=gen).to(device=device, dtype=torch.bfloat16)
    flops = 2 * M * N * K
    row = {"shape": name, "M": M, "N": N, "K": K}

    def record(key, fn, graph=True):
        try:
            ms = timed_ms(fn, device)
            row[key] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
        except Exception as e:  # a baseline this torch / GPU lacks: say why, go on
            row[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            return
        if device == "cuda" and graph:
            try:
                g = graph_ms(fn)
                row[key].update(graph_ms=g, graph_tflops=flops / (g * 1e-3) / 1e12)
            except Exception as e:
                row[key]["graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"

    model = Linear(w, ws)
    t0 = time.perf_counter()
    exe = kiln.compile(model, (x,), target=target, options=options)
    y = exe(x)
    sync(device)
    row["compile_s"] = time.perf_counter() - t0
    row["kiln_kernel"] = fp8_kernel(exe)
    want = model(x)  # the op's PyTorch form
    row["kiln_rel_err"] = rel_err(y.float(), want.float())
    record("kiln", lambda: exe(x))
    if isinstance(gemm_region(exe)[1], TritonKernel):
        try:
            g, out = time_gemm(exe, x, device)
            row["kiln_gemm"] = {"graph_ms": g, "graph_tflops": flops / (g * 1e-3) / 1e12,
                                "rel_err": rel_err(out.float(), want.float())}
        except Exception as e:
            row["kiln_gemm"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    if do_sweep:
        row["sweep"] = sweep(exe, x, want, flops, device)
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
    baselines = ("scaled_mm_rowwise", "scaled_mm_rowwise+quant", "scaled_mm_blockwise", "bf16")
    for key in baselines:
        other = row.get(key, {})
        for mine, theirs, prefix in (("tflops", "tflops", ""),
                                     ("graph_tflops", "graph_tflops", "graph_")):
            a, b = row["kiln"].get(mine), other.get(theirs)
            if a and b:
                row[f"{prefix}ratio_vs_{key}"] = a / b
        a, b = row.get("kiln_gemm", {}).get("graph_tflops"), other.get("graph_tflops")
        if a and b:
            row[f"gemm_graph_ratio_vs_{key}"] = a / b
    results["rows"].append(row)
    print(_line(row), flush=True)


def _line(row) -> str:
    def fig(key):
        r = row.get(key)
        if r is None:
            return "-"
        if "error" in r:
            return "err"
        g = f" | graph {r['graph_ms']:.4f} ms {r['graph_tflops']:.0f} TF" if "graph_ms" in r else ""
        return f"{r['ms']:.4f} ms {r['tflops']:.0f} TF{g}" if "ms" in r else g[3:]

    head = f"{row['shape']:>15} M={row['M']:<5} N={row['N']:<6} K={row['K']:<6}"
    kiln_part = f"kiln {fig('kiln')} (err {row['kiln_rel_err']:.1e}, {row['kiln_kernel']})"
    if "ratio_vs_scaled_mm_rowwise" not in row:
        return f"{head} {kiln_part} | kiln gemm {fig('kiln_gemm')}"
    ratios = " ".join(f"{k}={row[k]:.2f}" for k in (
        "gemm_graph_ratio_vs_scaled_mm_rowwise", "graph_ratio_vs_scaled_mm_rowwise+quant",
        "graph_ratio_vs_scaled_mm_blockwise", "graph_ratio_vs_bf16") if k in row)
    return (f"{head}\n    {kiln_part}\n    kiln gemm {fig('kiln_gemm')}\n"
            f"    rowwise {fig('scaled_mm_rowwise')}\n    +quant "
            f"{fig('scaled_mm_rowwise+quant')}\n    blockwise {fig('scaled_mm_blockwise')}\n"
            f"    bf16 {fig('bf16')}\n    {ratios}")


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
    ap.add_argument("--sweep", action="store_true",
                    help="also time every config of the GEMM (split-form shapes)")
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
               "torch": torch.__version__, "target": target, "options": options,
               "settings": effective(), "rows": []}  # KILN_FP8_GEMM_TMA among them
    print("settings: " + " ".join(f"{k}={v}" for k, v in results["settings"].items()))
    for name, (N, K) in shapes.items():
        for M in tokens:
            run_shape(name, N, K, M, a.device, target, options, results, a.sweep)
            if a.out:  # after every shape: a crash keeps what was measured
                with open(a.out, "w") as f:
                    json.dump(results, f, indent=2, default=str)
    return results


if __name__ == "__main__":
    main()
