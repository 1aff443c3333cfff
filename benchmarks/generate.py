"""Generation speed through kiln.models: time to first token and decode tokens/s, per batch
size, for the contiguous and the paged KV cache.

A preset (default llama3-8b) with random weights, optionally with fewer layers. Each
row: B prompts of --prompt-len tokens, --new-tokens greedy tokens each (eos ignored);
step_ms is a decode token's time in the loop, replay_ms the decode module's call alone
(its CUDA graph) at the same rows: the loop's own cost is their ratio.

    python benchmarks/generate.py --preset llama3-8b --layers 32 --batch 1 4 8 --out gen.txt
    python benchmarks/generate.py --preset tiny --target cpu      # a smoke run anywhere
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch


def main() -> None:
    from kiln.models.generate import LLM
    from kiln.models.hf import DTYPES, random_model
    from kiln.models.llama import PRESETS
    from kiln.models.tokenizer import ByteTokenizer
    from kiln.target import get_target

    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama3-8b", choices=list(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="default: the preset's")
    p.add_argument("--target", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--max-seq", type=int, default=2048)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--cache", nargs="+", default=["contiguous", "paged"],
                   choices=["contiguous", "paged"])
    p.add_argument("--out", default=None)
    args = p.parse_args()

    target = get_target(args.target)
    changes = {"max_seq_len": args.max_seq}
    if args.layers is not None:
        changes["n_layers"] = args.layers
    cfg = PRESETS[args.preset].with_(**changes)
    model = random_model(cfg, DTYPES[args.dtype], target.torch_device)
    lines = [f"# {args.preset} layers={cfg.n_layers} {args.dtype} target={target.name} "
             f"prompt={args.prompt_len} new={args.new_tokens}",
             "cache       batch  compile_s  first_ttft_ms  ttft_ms  decode_tok_s_per_seq  "
             "decode_tok_s_total  step_ms  replay_ms  step/replay"]
    print("\n".join(lines), flush=True)
    for cache in args.cache:
        llm = LLM(model, ByteTokenizer(), target=target, max_batch_size=max(args.batch),
                  paged=cache == "paged")
        # regions whose batch ends each run their own kernel (a size switch) show here
        kinds = Counter(k.kind for k in llm.decode_module.program.kplan.kernels.values())
        print(f"# {cache} decode module kernels: "
              + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())), flush=True)
        gen = torch.Generator().manual_seed(0)
        for b in args.batch:
            prompts = torch.randint(0, cfg.vocab_size, (b, args.prompt_len),
                                    generator=gen).tolist()
            # the first request after load: what a user of a fresh LLM waits for
            first = llm.generate(prompts, max_new_tokens=4, ignore_eos=True)
            first_ttft = first[0].time_to_first_token_s * 1e3
            if target.torch_device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, max_new_tokens=args.new_tokens, ignore_eos=True)
            wall = time.perf_counter() - t0
            ttft = outs[0].time_to_first_token_s * 1e3
            per_seq = outs[0].tokens_per_s
            total = sum(len(o.ids) for o in outs) / wall
            step = 1e3 / per_seq if per_seq else float("nan")
            replay = replay_ms(llm, b, args.prompt_len)
            line = (f"{cache:<10} {b:>6} {llm.compile_s:>10.1f} {first_ttft:>14.1f} {ttft:>8.1f} "
                    f"{per_seq:>21.1f} {total:>19.1f} {step:>8.3f} {replay:>10.3f} "
                    f"{step / replay:>12.3f}")
            lines.append(line)
            print(line, flush=True)
        del llm
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


def replay_ms(llm, batch: int, pos: int, iters: int = 50) -> float:
    """The decode module's call alone (its CUDA graph's replay on a GPU) at `batch` rows,
    device inputs: what the generate loop's decode step is compared against."""
    rows = next(b for b in llm.buckets if b >= batch) if llm.cuda_graphs else batch
    dev = llm.device
    tokens = torch.zeros(rows, 1, dtype=torch.long, device=dev)
    at = torch.full((rows, 1), pos, dtype=torch.long, device=dev)
    table = None
    if llm.paged:  # block 0 is never handed out: a timing step may write it
        table = torch.zeros(rows, llm.cache_layout.blocks_per_seq, dtype=torch.long,
                            device=dev)
    for _ in range(3):
        llm.forward(tokens, at, table)
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            llm.forward(tokens, at, table)
        return (time.perf_counter() - t0) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        llm.forward(tokens, at, table)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


if __name__ == "__main__":
    main()
