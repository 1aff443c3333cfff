"""Probe: where a decode step of a model people bring goes. One of hf_models.py's models
through transformers' static-cache recipe (bf16, real widths, its layer count), compiled
for one-token decode with CUDA graphs (KILN_TUNE as set), context `--tokens`: the step's
time, the floor (hf_models.decode_bytes at copy bandwidth), then one replay's kernels from
the profiler: totals by name and the second layer in order.

GPU: PYTHONPATH=. python benchmarks/probes/hf_decode_profile.py phi3-mini [--tokens 512]
     [--attn eager]   (transformers' attention written out: graph/eager_attention.py's)
"""

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hf_models import MODELS, build, decode_bytes  # noqa: E402
from measure import copy_bandwidth  # noqa: E402

import kiln  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("model", choices=list(MODELS))
ap.add_argument("--tokens", type=int, default=512)
ap.add_argument("--attn", choices=["sdpa", "eager"])
args = ap.parse_args()

from transformers.integrations.executorch import TorchExportableModuleWithStaticCache  # noqa: E402

model = build(args.model, False, "cuda", torch.bfloat16, args.attn)
model.generation_config.cache_implementation = "static"
cache_len = args.tokens + 8
mod = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=cache_len,
                                           device="cuda")
tok = torch.randint(3, 1000, (1, 1), device="cuda")
pos = torch.tensor([args.tokens], device="cuda")
with torch.no_grad():
    step = kiln.compile(mod, (), {"input_ids": tok, "cache_position": pos},
                        target="cuda").cuda_graphs()
    for _ in range(20):
        step(input_ids=tok, cache_position=pos)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(50):
        step(input_ids=tok, cache_position=pos)
    ev[1].record()
    torch.cuda.synchronize()
    us = ev[0].elapsed_time(ev[1]) / 50 * 1000
    floor = decode_bytes(model, cache_len) / copy_bandwidth("cuda") * 1e6
    layers = model.config.num_hidden_layers
    print(f"{args.model}: step {us:.1f} us, floor {floor:.1f} us ({us / floor:.2f}x), "
          f"{layers} layers, context {args.tokens}")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step(input_ids=tok, cache_position=pos)
        torch.cuda.synchronize()
evs = sorted([e for e in prof.events() if e.device_type.name == "CUDA"],
             key=lambda e: e.time_range.start)
n = len(evs) // 3
one = evs[n:2 * n]
tot = collections.defaultdict(lambda: [0.0, 0])
for e in one:
    tot[e.name[:70]][0] += e.time_range.end - e.time_range.start
    tot[e.name[:70]][1] += 1
span = one[-1].time_range.end - one[0].time_range.start
print(f"  {n} kernels, {sum(v[0] for v in tot.values()):.1f} us, span {span:.1f} us")
for k, (d, c) in sorted(tot.items(), key=lambda kv: -kv[1][0]):
    print(f"  {d:8.1f} us {c:4d}x {d / c:7.2f}  {k}")
per_layer = max(1, (n - 4) // layers)
print(f"  --- one layer in order (~{per_layer} kernels a layer)")
for e in one[per_layer: 3 * per_layer]:
    print(f"  {e.time_range.end - e.time_range.start:7.2f}  {e.name[:80]}")
