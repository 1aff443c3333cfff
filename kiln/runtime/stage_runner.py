"""One pipeline stage's call: receive, run, send, micro-batch by micro-batch, and every
rank returns the outputs.

The stage's Program reads the values earlier stages sent (`plan.recv`, in order per
sender) and produces the values later stages need (`plan.send`); p2p goes to the rank
of that stage with the same tensor-parallel rank. A call cut into M micro-batches
(micro_batches.py) is a GPipe schedule without a central clock: every receive of the
call is posted first, then the stage runs micro-batch m as soon as its inputs are in
and posts its sends without waiting for them, so while stage s+1 runs m, stage s is
already on m+1. Tags (micro-batch, value) keep the messages of a pair apart. Each run
is recorded in `timeline` (stage, micro-batch, start, end: host clock), which shows
the overlap. Sent values are copies: the next micro-batch reuses the arena.

Optionally a stage's step runs as a captured CUDA graph (cuda_graphs.StageGraphRunner):
the p2p stays outside it, between replays. The last stage alone computes the user
outputs, joins the micro-batches' and broadcasts them over its pipeline group, shapes
first (a small header: the other stages do not know a dynamic output's sizes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kiln.errors import KilnError
from kiln.ir.plan import Role
from kiln.ir.symbolic import evaluate
from kiln.runtime.distributed import agree, broadcast_tensors, post_recv, post_send, wait_all
from kiln.runtime.micro_batches import MicroBatches, plan_micro_batches

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_MAX_RANK = 8
_TAGS_PER_MICRO_BATCH = 1024  # values one stage sends another per micro-batch, at most


@dataclass(frozen=True)
class StageStep:
    """One run of a stage on one micro-batch, on the host clock (time.perf_counter,
    system-wide on Linux, so the ranks' steps of one machine compare)."""

    stage: int
    micro_batch: int
    start: float
    end: float


def _pair_indices(pairs) -> list[int]:
    """Per (value, peer) in order: its index among the values of that peer."""
    seen: dict[int, int] = {}
    out = []
    for peer in pairs:
        out.append(seen.get(peer, 0))
        seen[peer] = out[-1] + 1
    return out


class StageRunner:
    def __init__(self, program, parallel, n_outputs: int):
        self.program, self.cfg, self.n_outputs = program, parallel, n_outputs
        self.plan = program.plan
        self.micro: MicroBatches | None = None
        self.graphs = None  # a StageGraphRunner when the steps replay CUDA graphs
        self.timeline: list[StageStep] = []  # the last call's steps
        self._slots: list[dict] = []  # per micro-batch slot after the first: its caches
        self._slots_of = None  # the module state they copy
        self._state_targets = {v.target for v in self.plan.values.values()
                               if v.role == Role.STATE} | set(self.plan.state_writes)
        recv_idx = _pair_indices(src for _, src in self.plan.recv)
        self._recv = [(name, self._rank(src), j)
                      for (name, src), j in zip(self.plan.recv, recv_idx)]
        sends = [(i, d) for i, (_, dsts) in enumerate(self.plan.send) for d in dsts]
        self._send = [(i, self._rank(d), j)
                      for (i, d), j in zip(sends, _pair_indices(d for _, d in sends))]
        if max(recv_idx + [j for *_, j in self._send], default=0) >= _TAGS_PER_MICRO_BATCH:
            raise KilnError(f"a pipeline stage passes more than {_TAGS_PER_MICRO_BATCH} values "
                            "to one other stage per call")

    def _rank(self, stage: int) -> int:
        return self.cfg.rank_of(stage, self.cfg.tp_rank)

    def configure(self, count: int, split: str = "batch", dim: str | None = None) -> None:
        """Cut later calls into `count` micro-batches (micro_batches.py). Every rank
        calls it; a cut any stage refuses is an error on all of them."""
        error, micro = None, None
        try:
            micro = plan_micro_batches(self.plan, count, split, dim)
        except KilnError as e:
            error = e
        agree(error, f"{count} micro-batches cut by {split}")
        self.micro = micro if micro.count > 1 else None

    def _slot_states(self, state: dict, n: int) -> list[dict]:
        """Per micro-batch, the state it runs on: the module's own for slot 0; for the
        others (batch cuts only) its own copies of the updated buffers (the KV caches)
        over the module's current weights."""
        want = self.micro.slots if self.micro is not None else 1
        if len(self._slots) != want - 1 or self._slots_of is not state:
            self._slots = [{t: state[t].clone() for t in self._state_targets}
                           for _ in range(want - 1)]
            self._slots_of = state
        slots = [state] + [{**state, **copies} for copies in self._slots]
        return [slots[m % want] for m in range(n)]

    def run(self, flat: list[torch.Tensor], state) -> list[torch.Tensor]:
        pieces = self.micro.pieces(flat) if self.micro is not None else [flat]
        envs = [self.program.bind(p, self.plan.user_inputs) for p in pieces]
        slots = self._slot_states(state, len(pieces))
        many = len(pieces) > 1
        device = self.program.device
        posted = [self._post_recvs(env, m, device) for m, env in enumerate(envs)]
        outs, sends, peers = [], [], []
        self.timeline = []
        for m, (piece, env) in enumerate(zip(pieces, envs)):
            bufs, works, srcs = posted[m]
            wait_all(works, "receiving activations", srcs)
            start = time.perf_counter()
            if self.graphs is not None:
                out, sent = self.graphs.run_stage(piece, bufs, slots[m], env,
                                                  slot=m % (len(self._slots) + 1))
            else:
                out, sent = self.program.run_stage(piece, bufs, slots[m], env)
            self.timeline.append(StageStep(self.cfg.pp_rank, m, start, time.perf_counter()))
            if many:  # the next micro-batch reuses the arena these may live in
                sent = [t.clone() for t in sent]
            for i, dst, j in self._send:
                t = sent[i].contiguous()
                sends.append((post_send(t, dst, m * _TAGS_PER_MICRO_BATCH + j), t))
                peers.append(dst)
            outs.append(out)
        wait_all([w for w, _ in sends], "sending activations", peers)
        joined = self.micro.joined(outs) if many else outs[0]
        return self._outputs(joined, device)

    def _post_recvs(self, env, m: int, device):
        bufs, works, srcs = [], [], []
        for name, src, j in self._recv:
            v = self.plan.values[name]
            t = torch.empty([evaluate(d, env) for d in v.shape], dtype=v.dtype, device=device)
            works.append(post_recv(t, src, m * _TAGS_PER_MICRO_BATCH + j))
            bufs.append(t)
            srcs.append(src)
        return bufs, works, srcs

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
