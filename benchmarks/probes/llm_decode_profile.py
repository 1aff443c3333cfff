"""Probe: where kiln.models' own Llama decode step goes (issue 10 asks kiln.models'
generation for 1.10x the floor too). On an H200 (thirty-eighth session) its step at batch
1 replayed in 5.03 ms, 1.40x the bytes, where `kiln bench`'s gpt-fast-style model
decoded in 4.04 ms (1.13x) at the same widths; its decode module had 96 regions run
as torch ops (3 a layer, the tuner's picks). This lists, for an LLM of `--layers`
layers and each `--max-batch`, every region that does not run a Triton kernel (and
why), and the profiler's kernels of one batch-1 replay by total time.

GPU: PYTHONPATH=. python benchmarks/probes/llm_decode_profile.py [--layers 8]
        [--max-batch 1 4] [--tune fast]
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tune", default="fast")
    args = ap.parse_args()
    os.environ["KILN_TUNE"] = args.tune

    from kiln.models.generate import LLM
    from kiln.models.hf import random_model
    from kiln.models.llama import PRESETS
    from kiln.models.tokenizer import ByteTokenizer
    from kiln.target import get_target

    cfg = PRESETS["llama3-8b"].with_(n_layers=args.layers, max_seq_len=2048)
    model = random_model(cfg, torch.bfloat16, "cuda")
    for max_batch in args.max_batch:
        llm = LLM(model, ByteTokenizer(), target=get_target("cuda"), max_batch_size=max_batch)
        module = llm.decode_module
        kernels = module.program.kplan.kernels
        print(f"== max batch {max_batch}: {len(kernels)} regions", flush=True)
        for r in module.program.plan.regions:
            k = kernels[r.name]
            if k.kind != "triton":
                why = [n for n in r.notes if "extern" in n or "switch" in n or "tuned" in n]
                print(f"   {r.name} {r.kind.value} -> {k.kind}: {'; '.join(why)[:300]}")
        tokens = torch.zeros(1, 1, dtype=torch.long, device="cuda")
        at = torch.full((1, 1), 128, dtype=torch.long, device="cuda")
        for _ in range(3):
            llm.forward(tokens, at, None)
        torch.cuda.synchronize()
        calls = 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                llm.forward(tokens, at, None)
            torch.cuda.synchronize()
        total = defaultdict(float)
        count = defaultdict(int)
        for e in prof.events():
            if e.device_type.name == "CUDA":
                total[e.name[:80]] += e.time_range.elapsed_us() / calls
                count[e.name[:80]] += 1
        print(f"   kernels a step: {sum(count.values()) / calls:.0f}, "
              f"{sum(total.values()):.1f} us")
        for name, us in sorted(total.items(), key=lambda x: -x[1])[:14]:
            print(f"   {us:8.1f} us  x{count[name] // calls:<3} {name}")
        del llm


if __name__ == "__main__":
    main()
