"""Probe: where a decode step of kiln bench's model goes (issue 10). The gpt-fast-style
Llama-3-8B subject at N layers (default 8), fp16, compiled for decode with CUDA graphs
(KILN_TUNE as set), replayed at contexts 128 and 2048: the step's time, then one
replay's kernels from the profiler, totals by name and the first layer in order.

GPU: PYTHONPATH=. KILN_TUNE=none python benchmarks/probes/decode_profile_llama.py [layers]
"""

import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import kiln
from kiln.bench.subject import PRESETS, build

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
s = PRESETS["llama3-8b"].with_(layers=layers)
model = build(s, torch.float16, "cuda")
ex = (torch.zeros(1, 1, dtype=torch.long, device="cuda"),
      torch.zeros(1, dtype=torch.long, device="cuda"))
m = kiln.compile(model, ex, target="cuda")
m.cuda_graphs()
tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
for ctx in (128, 2048):
    pos = torch.tensor([ctx], device="cuda")
    for _ in range(20):
        m(tok, pos)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(50):
        m(tok, pos)
    ev[1].record()
    torch.cuda.synchronize()
    print(f"ctx {ctx}: step {ev[0].elapsed_time(ev[1]) / 50 * 1000:.1f} us ({layers} layers)")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            m(tok, pos)
        torch.cuda.synchronize()
    evs = sorted([e for e in prof.events() if e.device_type.name == "CUDA"],
                 key=lambda e: e.time_range.start)
    n = len(evs) // 3
    one = evs[n:2 * n]
    tot = collections.defaultdict(lambda: [0.0, 0])
    for e in one:
        d = e.time_range.end - e.time_range.start
        tot[e.name[:60]][0] += d
        tot[e.name[:60]][1] += 1
    span = one[-1].time_range.end - one[0].time_range.start
    print(f"  {n} kernels, {sum(v[0] for v in tot.values()):.1f} us, span {span:.1f} us")
    for k, (d, c) in sorted(tot.items(), key=lambda kv: -kv[1][0]):
        print(f"  {d:8.1f} us {c:4d}x {d / c:7.2f}  {k}")
    print("  --- first layer in order")
    for e in one[:16]:
        print(f"  {e.time_range.end - e.time_range.start:7.2f}  {e.name[:70]}")
