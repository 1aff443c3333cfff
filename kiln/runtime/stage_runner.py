"""One pipeline stage's call: receive, run, send, and every rank returns the outputs.

The stage's Program reads the values earlier stages sent (`plan.recv`, in order per
sender) and produces the values later stages need (`plan.send`); p2p goes to the rank
of that stage with the same tensor-parallel rank. Sends are posted before waiting, so
no order of stages can deadlock. The last stage alone computes the user outputs and
broadcasts them over its pipeline group, shapes first (a small header: the other stages
do not know a dynamic output's sizes), so every rank returns the full output.
"""

from __future__ import annotations

import torch

from kiln.ir.symbolic import evaluate
from kiln.runtime.distributed import broadcast_tensors, recv_tensors, send_tensors

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_MAX_RANK = 8


class StageRunner:
    def __init__(self, program, parallel, n_outputs: int):
        self.program, self.cfg, self.n_outputs = program, parallel, n_outputs
        self.plan = program.plan

    def _rank(self, stage: int) -> int:
        return self.cfg.rank_of(stage, self.cfg.tp_rank)

    def run(self, flat: list[torch.Tensor], state, env) -> list[torch.Tensor]:
        plan, device = self.plan, self.program.device
        received = []
        for name, src in plan.recv:
            v = plan.values[name]
            spec = ([evaluate(d, env) for d in v.shape], v.dtype)
            received += recv_tensors([spec], self._rank(src), device)
        outs, sent = self.program.run_stage(flat, received, state, env)
        for (_, dsts), t in zip(plan.send, sent):
            for d in dsts:
                send_tensors([t], self._rank(d))
        return self._outputs(outs, device)

    def _outputs(self, outs: list[torch.Tensor], device) -> list[torch.Tensor]:
        last = self._rank(self.cfg.pp - 1)
        header = torch.zeros(self.n_outputs, 2 + _MAX_RANK, dtype=torch.int64)
        if self.cfg.pp_rank == self.cfg.pp - 1:
            for i, t in enumerate(outs):
                header[i, 0], header[i, 1] = _DTYPES.index(t.dtype), t.dim()
                header[i, 2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        header = header.to(device)
        broadcast_tensors([header], last)
        if self.cfg.pp_rank != self.cfg.pp - 1:
            rows = header.cpu().tolist()
            outs = [torch.empty(r[2:2 + r[1]], dtype=_DTYPES[r[0]], device=device)
                    for r in rows]
        broadcast_tensors(outs, last)
        return outs

