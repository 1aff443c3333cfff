"""One rank of test_tp_runs.py's two-"node" run: started by torchrun itself (`torchrun
--nnodes 2 --node-rank N ... tests/parallel/torchrun_rank.py OUT`, twice), it runs the
tiny Llama TP check as its world rank and saves the result to OUT/rank<RANK>.pt."""

from __future__ import annotations

import os
import sys

import torch

from tests.parallel.test_tp_runs import _tiny_tp

if __name__ == "__main__":
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    where = {k: int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK")}
    result = _tiny_tp(rank, world, {}, {}, [])
    torch.save((where, result), os.path.join(sys.argv[1], f"rank{rank}.pt"))
