"""End-to-end Llama prefill and decode: kiln beside eager PyTorch, torch.compile and the
memory-bandwidth floor, on one GPU, in one run.

A Llama-3-8B-shaped model (dim 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128256)
with fewer layers (default 4) and random fp16 weights. Decode reads every weight once
per token (the embedding table excepted: one row of it) and the KV cache up to its
position, so its floor is those bytes / measured copy bandwidth. Ratios are what to
read: kiln / eager, kiln / torch.compile, floor / kiln.

    python benchmarks/llama_e2e.py --layers 4 --out results.txt
"""

from __future__ import annotations

import argparse
import copy
import time

import torch


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    import triton

    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    return 2 * n / (ms * 1e-3)


def bench(fn, warmup=5, iters=30) -> float:
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


def profile(label: str, fn, iters: int = 10, top: int = 12) -> list[str]:
    """GPU time per call of the kernels `fn` launches, largest first (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for e in p.key_averages():
        t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows[e.key] = (t / iters, e.count // iters)
    total = sum(t for t, _ in rows.values())
    out = [f"-- {label}: {total / 1e3:.3f} ms of kernels per call"]
    for k, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"   {t / 1e3:8.3f} ms {100 * t / total:5.1f}%  x{n:<4} {k[:70]}")
    return out


def main() -> None:
    import kiln
    from kiln.models.llama import PRESETS, Llama, LlamaConfig

    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--max-seq", type=int, default=2048)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--no-torch-compile", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="also print where kiln's prefill and decode spend GPU time")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    cfg = LlamaConfig(**{**PRESETS["llama3-8b"].__dict__, "n_layers": args.layers,
                         "max_seq_len": args.max_seq})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Llama(cfg).to(dtype).eval()
    for prm in model.parameters():
        torch.nn.init.normal_(prm, std=0.02)
    model.setup_cache(dtype)
    emb = model.model.embed_tokens.weight
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters()
                       if t is not emb or cfg.tie_word_embeddings)
    kv_bytes = 2 * cfg.n_layers * args.prefill * cfg.n_kv_heads * cfg.head_dim * emb.element_size()
    bw = copy_bandwidth()
    rows = []

    T = torch.export.Dim("seq", min=1, max=cfg.max_seq_len)
    ex = (torch.randint(0, cfg.vocab_size, (1, 16), device="cuda"),
          torch.arange(16, device="cuda"))
    t0 = time.perf_counter()
    exe = kiln.compile(model, ex, dynamic_shapes=({1: T}, {0: T}), target="cuda")
    compile_s = time.perf_counter() - t0
    kinds: dict[str, int] = {}
    for k in exe.program.kplan.kernels.values():
        kinds[k.kind] = kinds.get(k.kind, 0) + 1
    # Decode as kiln generate runs it: a module compiled for one token (GEMV / split
    # forms tuned at that size), sharing the model's weights and KV cache.
    t0 = time.perf_counter()
    dec = kiln.compile(model, (ex[0][:, :1], ex[1][:1]), target="cuda")
    compile_s += time.perf_counter() - t0
    eager = copy.deepcopy(model)
    compiled = None if args.no_torch_compile else torch.compile(copy.deepcopy(model))

    prompt = torch.randint(0, cfg.vocab_size, (1, args.prefill), device="cuda")
    ppos = torch.arange(args.prefill, device="cuda")
    tok = torch.randint(0, cfg.vocab_size, (1, 1), device="cuda")
    dpos = torch.tensor([args.prefill], device="cuda")
    with torch.no_grad():
        err = (exe(prompt, ppos).float() - eager(prompt, ppos).float()).norm() / \
            eager(prompt, ppos).float().norm()
        rows.append(("prefill", "eager", bench(lambda: eager(prompt, ppos))))
        if compiled is not None:
            rows.append(("prefill", "torch.compile", bench(lambda: compiled(prompt, ppos))))
        rows.append(("prefill", "kiln", bench(lambda: exe(prompt, ppos))))
        rows.append(("decode", "eager", bench(lambda: eager(tok, dpos))))
        if compiled is not None:
            rows.append(("decode", "torch.compile", bench(lambda: compiled(tok, dpos))))
        rows.append(("decode", "kiln (prefill module)", bench(lambda: exe(tok, dpos))))
        rows.append(("decode", "kiln", bench(lambda: dec(tok, dpos))))
        dec.cuda_graphs()
        rows.append(("decode", "kiln+cudagraphs", bench(lambda: dec(tok, dpos))))
    floor_ms = (weight_bytes + kv_bytes) / bw * 1e3
    lines = [
        f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"layers {args.layers}  dtype {args.dtype}",
        f"copy bandwidth {bw / 1e9:.0f} GB/s; decode reads {weight_bytes / 1e9:.2f} GB of "
        f"weights + {kv_bytes / 1e6:.1f} MB of KV cache; "
        f"decode floor {floor_ms:.3f} ms",
        f"kiln compile {compile_s:.1f} s; kernels {kinds}; prefill rel err vs eager {err:.2e}",
        f"{'phase':8} {'runner':22} {'ms':>9} {'vs eager':>9} {'floor/it':>9}",
    ]
    base = {ph: ms for ph, r, ms in rows if r == "eager"}
    for ph, r, ms in rows:
        floor = f"{floor_ms / ms:9.2f}" if ph == "decode" else f"{'':9}"
        lines.append(f"{ph:8} {r:22} {ms:9.3f} {base[ph] / ms:9.2f} {floor}")
    if args.profile:
        with torch.no_grad():
            lines += profile("kiln prefill", lambda: exe(prompt, ppos))
            lines += profile("kiln decode (graphs)", lambda: dec(tok, dpos))
            if compiled is not None:
                lines += profile("torch.compile prefill", lambda: compiled(prompt, ppos))
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
