"""Pipeline parallelism with micro-batches: PP2 call time with M = 1 against M = 2, 4.

A small Llama split into 2 stages; a batch of B rows prefilled (T tokens) and decoded
(1 token) as M micro-batches (CompiledModule.micro_batches, a batch cut), plus a
prefill cut into M sequence chunks. Each rank also reports how busy its stage was:
the time its steps ran over the call's wall time (GPipe's ideal: M / (M + P - 1)).
Every output is checked against the same model run whole in the process (fp32).

    python benchmarks/pp_micro_batches.py --out pp.json            # CPU: spawns 2 gloo ranks
    torchrun --nproc-per-node 2 benchmarks/pp_micro_batches.py --device cuda --out pp.json
    torchrun --nproc-per-node 2 benchmarks/pp_micro_batches.py --device cuda --cuda-graphs \\
        --out pp-graphs.json

On the CPU the ranks share the machine's cores, so the times only inform; on GPUs
(NCCL) they are the point. Host times: on a GPU a stage's step is timed on the host
after a synchronize, so the busy fraction there is the host's view of it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _median_ms(fn, device: str, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _busy(module) -> float:
    """This stage's step time over the last call's span (all stages' first to last)."""
    steps = module.pipeline_timeline
    mine = [(s.start, s.end) for s in steps]
    spans: list = [None] * dist.get_world_size()
    dist.all_gather_object(spans, mine)
    flat = [t for s in spans for t in s]
    wall = max(e for _, e in flat) - min(s for s, _ in flat)
    return sum(e - s for s, e in mine) / wall if wall > 0 else 0.0


def run(args) -> dict:
    import kiln
    from kiln.models.llama import tiny_llama

    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(max(1, args.threads))
    B, T = args.batch, args.prefill
    shape = dict(dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                 intermediate_size=args.dim * 11 // 4, vocab_size=args.vocab,
                 max_seq_len=T + 16)
    model, eager = tiny_llama(**shape), tiny_llama(**shape)
    for m in (model, eager):
        m.setup_cache(max_batch_size=B)
        m.to(device)
    batch = torch.export.Dim("batch", min=1, max=B)
    seq = torch.export.Dim("seq", min=1, max=T + 16)
    example = (torch.zeros(2, 8, dtype=torch.long, device=device),
               torch.arange(8, device=device))
    t0 = time.perf_counter()
    module = kiln.compile(model, example, dynamic_shapes=({0: batch, 1: seq}, {0: seq}),
                          target=device, parallel={"pp": int(os.environ["WORLD_SIZE"])})
    compile_s = time.perf_counter() - t0
    if args.cuda_graphs:
        module.cuda_graphs()
    torch.manual_seed(0)
    prompt = torch.randint(0, args.vocab, (B, T), device=device)
    step = torch.randint(0, args.vocab, (B, 1), device=device)
    pos, at = torch.arange(T, device=device), torch.tensor([T], device=device)
    with torch.no_grad():
        want_prefill, want_decode = eager(prompt, pos), eager(step, at)
    rows = []
    for split, counts in (("batch", (1, 2, 4)), ("sequence", (2, 4))):
        for m in counts:
            if B % m and split == "batch":
                continue
            module.micro_batches(m, split)
            row = {"split": split, "micro_batches": m}
            got = module(prompt, pos)
            row["prefill_rel_err"] = ((got - want_prefill).norm() / want_prefill.norm()).item()
            row["prefill_ms"] = _median_ms(lambda: module(prompt, pos), device, args.reps)
            row["prefill_busy"] = _busy(module)
            if split == "batch":
                module(prompt, pos)  # the cache as the eager model's before its decode
                got = module(step, at)
                row["decode_rel_err"] = ((got - want_decode).norm() / want_decode.norm()).item()
                row["decode_ms"] = _median_ms(lambda: module(step, at), device, args.reps)
                row["decode_busy"] = _busy(module)
            rows.append(row)
    return dict(device=(torch.cuda.get_device_name() if device == "cuda" else "cpu (gloo)"),
                pp=dist.get_world_size(), rank=dist.get_rank(), batch=B, prefill=T,
                model=shape, cuda_graphs=args.cuda_graphs, compile_s=round(compile_s, 1),
                rows=rows)


def _rank_main(rank, world, port, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _report(args)


def _report(args):
    result = run(args)
    results: list = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
        for i, row in enumerate(result["rows"]):  # the times are rank 0's; busy per stage
            busy = {k: [round(res["rows"][i][k], 2) for res in results]
                    for k in ("prefill_busy", "decode_busy") if k in row}
            print(json.dumps({**row, **busy}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file for the per-rank results")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--cuda-graphs", action="store_true", help="each stage's step as graphs")
    p.add_argument("--ranks", type=int, default=2, help="stages, when not under torchrun")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prefill", type=int, default=64)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    args = p.parse_args()
    if "RANK" in os.environ:
        _report(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(args.ranks, port, args), nprocs=args.ranks)


if __name__ == "__main__":
    main()
