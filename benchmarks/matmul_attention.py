"""kiln's matmul and attention templates beside cuBLAS / SDPA (eager torch) and
torch.compile, on Llama-3-8B shapes, prefill and decode, on one GPU.

Each case is a one-op module (a linear layer, or SDPA with GQA) compiled by kiln for
the local GPU (tuned, timed against its extern form) and by torch.compile; all three
are timed with CUDA events on the same inputs and checked against eager. Read the
ratios: eager / kiln > 1 means kiln is faster.

    python benchmarks/matmul_attention.py --out results.json [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

DIM, HEADS, KV_HEADS, HEAD_DIM, FFN = 4096, 32, 8, 128, 14336


class Linear(torch.nn.Module):
    def __init__(self, k: int, n: int):
        super().__init__()
        self.lin = torch.nn.Linear(k, n, bias=False)

    def forward(self, x):
        return self.lin(x)


class Attention(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v, mask):
        if self.causal:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def cases(prefill: int, cache: int, batch: int):
    """(name, phase, module, args, flops, bytes moved) for Llama-3-8B's matmuls and attention."""
    out = []
    for phase, t in (("prefill", prefill), ("decode", 1)):
        m = batch * t
        for name, k, n in (("q_proj", DIM, DIM), ("kv_proj", DIM, KV_HEADS * HEAD_DIM),
                           ("o_proj", DIM, DIM), ("gate_up", DIM, FFN), ("down", FFN, DIM)):
            out.append((name, phase, Linear(k, n), lambda m=m, k=k: (torch.randn(1, m, k),),
                        2 * m * k * n, 2 * (m * k + k * n + m * n)))
    s = prefill
    out.append(("attention_causal", "prefill", Attention(True),
                lambda: (torch.randn(batch, HEADS, s, HEAD_DIM),
                         torch.randn(batch, KV_HEADS, s, HEAD_DIM),
                         torch.randn(batch, KV_HEADS, s, HEAD_DIM), torch.ones(1)),
                2 * 2 * batch * HEADS * s * s * HEAD_DIM // 2,
                2 * batch * (HEADS + 2 * KV_HEADS) * s * HEAD_DIM * 2))
    pos = cache - 1
    out.append(("attention_cache", "decode", Attention(False),
                lambda: (torch.randn(batch, HEADS, 1, HEAD_DIM),
                         torch.randn(batch, KV_HEADS, cache, HEAD_DIM),
                         torch.randn(batch, KV_HEADS, cache, HEAD_DIM),
                         torch.arange(cache)[None, :] <= pos),
                2 * 2 * batch * HEADS * cache * HEAD_DIM,
                2 * batch * 2 * KV_HEADS * cache * HEAD_DIM))
    return out


def bench(fn, warmup=10, iters=50) -> float:
    """Median milliseconds of fn() with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def run_case(name, phase, module, make_args, flops, nbytes, dtype, tune, use_compile):
    import kiln

    torch.manual_seed(0)
    module = module.to("cuda", dtype).eval()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    args = tuple(a.to("cuda", dtype) if a.is_floating_point() else a.to("cuda")
                 for a in make_args())
    t0 = time.perf_counter()
    exe = kiln.compile(module, args, target="cuda", options={"tune": tune})
    compile_s = time.perf_counter() - t0
    kernel = next(iter(exe.program.kplan.kernels.values()))
    row = {"case": name, "phase": phase, "dtype": str(dtype).replace("torch.", ""),
           "kiln_kernel": kernel.kind,
           "kiln_config": str(getattr(kernel, "config", "")),
           "kiln_form": getattr(getattr(kernel, "spec", None), "meta", {}).get("form"),
           "kiln_compile_s": round(compile_s, 1)}
    with torch.no_grad():
        ref = module(*args)
        row["kiln_rel_err"] = rel_err(exe(*args), ref)
        row["eager_ms"] = bench(lambda: module(*args))
        row["kiln_ms"] = bench(lambda: exe(*args))
        if use_compile:
            compiled = torch.compile(module)
            compiled(*args)
            row["torch_compile_ms"] = bench(lambda: compiled(*args))
    for runner in ("eager", "kiln", "torch_compile"):
        ms = row.get(f"{runner}_ms")
        if ms:
            row[f"{runner}_tflops"] = round(flops / (ms * 1e-3) / 1e12, 2)
            row[f"{runner}_gbps"] = round(nbytes / (ms * 1e-3) / 1e9, 1)
    row["eager_over_kiln"] = round(row["eager_ms"] / row["kiln_ms"], 3)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--cache", type=int, default=2048, help="KV length for decode attention")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tune", default="fast", choices=["none", "fast", "full"])
    p.add_argument("--no-torch-compile", action="store_true")
    p.add_argument("--only", default=None, help="comma-separated case names")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for case in cases(args.prefill, args.cache, args.batch):
        if args.only and case[0] not in args.only.split(","):
            continue
        try:
            row = run_case(*case, dtype, args.tune, not args.no_torch_compile)
        except Exception as e:  # one failing case must not hide the others' numbers
            row = {"case": case[0], "phase": case[1], "error": f"{type(e).__name__}: {e}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    import triton

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "dtype": args.dtype, "prefill": args.prefill,
              "cache": args.cache, "batch": args.batch, "tune": args.tune, "rows": rows}
    print(f"{'case':18} {'phase':8} {'eager ms':>9} {'kiln ms':>9} {'compile ms':>10} "
          f"{'eager/kiln':>10} {'err':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:18} {r['phase']:8} ERROR {r['error'][:80]}")
            continue
        tc = r.get("torch_compile_ms")
        print(f"{r['case']:18} {r['phase']:8} {r['eager_ms']:9.4f} {r['kiln_ms']:9.4f} "
              f"{(f'{tc:10.4f}' if tc else '         -')} {r['eager_over_kiln']:10.2f} "
              f"{r['kiln_rel_err']:8.1e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
