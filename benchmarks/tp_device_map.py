"""A TP plan on fewer GPUs than ranks through device_map (issue 9 item 1: "a TP8 plan
runs ... on fewer GPUs where a test needs it"): the tiny Llama under TP=N with every
rank mapped onto GPU 0, against eager on that GPU. Not run yet (no GPU where it was
written); NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so this checks
whether kiln's device_map path works there at all:

    torchrun --nproc-per-node 2 benchmarks/tp_device_map.py            # both on GPU 0
    torchrun --nproc-per-node 2 benchmarks/tp_device_map.py --spread   # one GPU each
"""

from __future__ import annotations

import os
import sys

import torch

import kiln
from kiln.models.llama import example_inputs, tiny_llama

if __name__ == "__main__":
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    spread = "--spread" in sys.argv
    mapping = None if spread else {r: 0 for r in range(world)}
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) if spread else 0)
    model, eager = tiny_llama(), tiny_llama()
    model, eager = model.cuda(), eager.cuda()
    args, ds = example_inputs(model.cfg, seq_len=5)
    args = tuple(a.cuda() for a in args)
    module = kiln.compile(model, args, dynamic_shapes=ds, target="cuda",
                          parallel={"tp": world}, devices=world if spread else 1,
                          device_map=mapping)
    with torch.no_grad():
        got, want = module(*args), eager(*args)
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    print(f"rank {rank} on cuda:{torch.cuda.current_device()}: rel err {err:.2e}", flush=True)
