"""Tensor-parallel Llama on several GPUs (NCCL): outputs against one GPU, times against
the floor, scaling from TP1.

Each rank builds a Llama-3-8B-shaped model (or --preset llama2-70b) on the meta device,
compiles its part with kiln.models.LLM(parallel={"tp": T}) and makes random fp16
weights for its own slices only: every weight is drawn whole on the GPU from a seed
derived from its name and then cut, so TP1 and TPn hold the same model without any
rank ever holding all of it at once. Decode runs as CUDA graphs with the all-reduces
inside them. Run each world size, then compare:

    torchrun --nproc-per-node 2 benchmarks/tp_llama.py --out DIR
    python benchmarks/tp_llama.py --out DIR                 # TP1
    python benchmarks/tp_llama.py --compare DIR

Decode's floor per GPU: (this rank's weight bytes + KV bytes read) / measured copy
bandwidth, plus the measured all-reduce time of its activations.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from kiln.models.generate import LLM
from kiln.models.llama import PRESETS, Llama


def bench(fn, warmup=3, iters=20) -> float:
    """Median milliseconds of fn() with CUDA events (every rank times its own)."""
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
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a), iters=50)
    return 2 * n / (ms * 1e-3)


def random_reader(model: Llama):
    """read_weights for LLM: each weight drawn whole from a per-name seed, then cut."""
    params = dict(model.named_parameters(remove_duplicate=False))

    def read(wanted: dict) -> dict:
        out = {}
        for name, cut in wanted.items():
            p = params[name]
            seed = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
            gen = torch.Generator(device="cuda").manual_seed(seed)
            if p.dim() == 1:
                full = 1.0 + 0.1 * torch.randn(p.shape, generator=gen, device="cuda")
            else:
                full = 0.02 * torch.randn(p.shape, generator=gen, device="cuda")
            full = full.to(torch.float16)
            if cut is not None:
                axis, ranges = cut
                full = torch.cat([full.narrow(axis, a, b - a) for a, b in ranges], axis)
            out[name] = full.contiguous()
        return out

    return read


def run(args) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    pp = args.pp
    tp = world // pp
    if world > 1:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    cfg = PRESETS[args.preset].with_(max_seq_len=args.context + 64)
    if args.layers:
        cfg = cfg.with_(n_layers=args.layers)
    with torch.device("meta"):
        model = Llama(cfg).to(torch.float16)
    model.init_rope("meta")
    t0 = time.perf_counter()
    llm = LLM(model, None, target="cuda", max_batch_size=args.batch,
              cuda_graphs=False if args.no_cuda_graphs else None,
              parallel={"tp": tp, "pp": pp} if world > 1 else None,
              read_weights=random_reader(model))
    compile_s = time.perf_counter() - t0
    held = {n: t for m in llm.modules() for n, t in m.state.items()}
    params = dict(model.named_parameters(remove_duplicate=False))
    weight_bytes = sum(t.numel() * t.element_size() for n, t in held.items()
                       if n in params and "embed_tokens" not in n)
    torch.manual_seed(0)
    B, T = args.batch, args.prefill
    prompt = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")
    pos = torch.arange(T, device="cuda").expand(B, T)
    last = torch.full((B, 1), T - 1, device="cuda")  # generation's prefill: logits at the end

    def prefill():
        return llm.forward(prompt, pos, logits_at=last)

    logits_prefill = prefill()[:, -1].float().cpu()
    step = torch.randint(0, cfg.vocab_size, (B, 1), device="cuda")
    logits_decode = llm.forward(step, torch.full((B, 1), T, device="cuda")).float().cpu()
    prefill_ms = bench(prefill, warmup=2, iters=10)
    ctx_pos = torch.full((B, 1), args.context - 1, device="cuda")
    decode_ms = bench(lambda: llm.forward(step, ctx_pos))
    tokens = llm.generate(prompt[0].tolist(), max_new_tokens=16).ids
    bw = copy_bandwidth()
    kv_bytes = (2 * cfg.n_layers * B * args.context * max(cfg.n_kv_heads // tp, 1)
                * cfg.head_dim * 2) // pp
    if pp > 1:  # stages run one after another: a token reads every stage's bytes in turn
        total = torch.tensor([weight_bytes + kv_bytes], dtype=torch.float64, device="cuda")
        dist.all_reduce(total)
        weight_bytes, kv_bytes = int(total.item()) // tp, 0
    act = torch.randn(B, cfg.dim, dtype=torch.float16, device="cuda")
    if tp > 1:
        allreduce_ms = bench(lambda: dist.all_reduce(act), iters=50) * (2 * cfg.n_layers + 1)
    else:
        allreduce_ms = 0.0
    floor_ms = (weight_bytes + kv_bytes) / bw * 1e3 + allreduce_ms
    result = dict(tp=tp, pp=pp, rank=rank, preset=args.preset, layers=cfg.n_layers, batch=B,
                  prefill=T, context=args.context, compile_s=round(compile_s, 1),
                  prefill_ms=prefill_ms, decode_ms=decode_ms, floor_ms=floor_ms,
                  floor_over_decode=floor_ms / decode_ms, allreduce_ms=allreduce_ms,
                  weight_gib=weight_bytes / 2**30, copy_tbs=bw / 1e12, tokens=tokens,
                  cuda_graphs=llm.cuda_graphs,
                  device=torch.cuda.get_device_name())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    label = f"tp{tp}" + (f"pp{pp}" if pp > 1 else "")
    if rank == 0:
        torch.save({"prefill": logits_prefill, "decode": logits_decode},
                   out / f"logits-{label}-b{B}.pt")
        (out / f"{label}-b{B}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "tokens"}), flush=True)


def compare(out: Path) -> None:
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("tp*-b*.json"))]
    for r in rows:
        r.setdefault("pp", 1)
    base = {r["batch"]: r for r in rows if r["tp"] == 1 and r.get("pp", 1) == 1}
    print("| TP | PP | batch | prefill ms | decode ms | floor ms | floor/decode | speed-up vs TP1 "
          "(prefill, decode) | rel err vs TP1 (prefill, decode) | greedy tokens = TP1 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["batch"], r["tp"])):
        b = base.get(r["batch"])
        errs = ("", "")
        same = ""
        if b is not None:
            label = f"tp{r['tp']}" + (f"pp{r['pp']}" if r.get("pp", 1) > 1 else "")
            mine = torch.load(out / f"logits-{label}-b{r['batch']}.pt")
            ref = torch.load(out / f"logits-tp1-b{r['batch']}.pt")
            errs = tuple(f"{((mine[k] - ref[k]).norm() / ref[k].norm()).item():.1e}"
                         for k in ("prefill", "decode"))
            same = str(r["tokens"] == b["tokens"])
        speed = (f"{b['prefill_ms'] / r['prefill_ms']:.2f}x, {b['decode_ms'] / r['decode_ms']:.2f}x"
                 if b else "")
        print(f"| {r['tp']} | {r['pp']} | {r['batch']} | {r['prefill_ms']:.2f} | "
              f"{r['decode_ms']:.3f} | "
              f"{r['floor_ms']:.3f} | {r['floor_over_decode']:.2f} | {speed} | "
              f"{errs[0]}, {errs[1]} | {same} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the preset")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--context", type=int, default=2048, help="decode position timed")
    p.add_argument("--out", default="tp-results")
    p.add_argument("--compare", action="store_true", help="tabulate the runs in --out")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (of WORLD_SIZE ranks)")
    args = p.parse_args()
    if args.compare:
        compare(Path(args.out))
    else:
        run(args)


if __name__ == "__main__":
    main()
