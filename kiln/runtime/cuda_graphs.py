"""Replay a Program as captured CUDA graphs: one graph per set of sizes (a bucket).

A decode step launches hundreds of small kernels; replaying them as one CUDA graph
removes the per-launch CPU cost. Each graph owns its static inputs, its outputs and
its own arena, so capturing a new bucket never moves a captured graph's memory.
State (the KV cache) is updated in place by the graph, as by a plain run.
Prefill, whose sizes vary call to call, should run without graphs. A pipeline
stage's step is captured the same way (StageGraphRunner), its p2p left outside.
A module whose sizes come from an int argument (Meta's `start_pos`) is refused: its
value changes every decode step, so every step would capture a graph of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kiln.errors import ArgumentError, TargetError
from kiln.ir.plan import Ref, Role
from kiln.runtime.memory_plan import Arena
from kiln.runtime.program import Program

log = logging.getLogger("kiln.runtime")


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    # The graph replays into these addresses: the arena must live as long as the graph,
    # or its memory returns to the allocator and a replay writes into someone else's.
    arena: Arena


class GraphRunner:
    """Runs `program` through CUDA graphs keyed by the bound sizes."""

    def __init__(self, program: Program, max_graphs: int = 16, warmup: int = 2):
        _refuse_size_args(program)
        if program.device.type != "cuda":
            raise TargetError(f"CUDA graphs need a module compiled for a CUDA target, not "
                              f"{program.kplan.target}",
                              hint="compile with target='cuda', or call the module without "
                              "cuda_graphs()")
        if not torch.cuda.is_available():
            raise TargetError("CUDA graphs need a GPU, and torch sees none here",
                              hint="call the module without cuda_graphs() on this machine")
        self.program = program
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.graphs: dict[tuple, _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _step(self, prog: Program, static: list[torch.Tensor], state, env,
              arena) -> list[torch.Tensor]:
        """The work a graph captures, on its static inputs and its own arena."""
        return prog.run(static, state, env, arena=arena)

    def _key(self, args: list[torch.Tensor], env: dict[str, int]) -> tuple:
        return tuple(sorted(env.items())) + tuple(tuple(a.shape) for a in args)

    def _capture(self, args, state, env) -> _Captured:
        prog = self.program.for_sizes(env)  # the narrow version at its sizes
        arena = Arena(prog.mem, prog.plan, prog.device)
        static = [a.clone() for a in args]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # Warm-up runs load modules and settle allocations outside the capture. They
        # repeat this very call: scatters into the KV cache write the same rows with the
        # same values, so only plans whose state updates read the state need a snapshot.
        snapshot = {} if idempotent(prog) else {
            k: v.clone() for k, v in state.items() if k in _state_targets(prog)}
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._step(prog, static, state, env, arena)
        torch.cuda.current_stream().wait_stream(side)
        for k, v in snapshot.items():
            state[k].copy_(v)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outs = self._step(prog, static, state, env, arena)
        log.info("captured a CUDA graph for sizes %s", env)
        return _Captured(graph, static, outs, arena)

    def run(self, args: list[torch.Tensor], state: dict[str, torch.Tensor],
            env: dict[str, int]) -> list[torch.Tensor]:
        key = self._key(args, env)
        cap = self.graphs.get(key)
        if cap is None:
            if len(self.graphs) >= self.max_graphs:
                return self.program.for_sizes(env).run(args, state, env)
            cap = self._capture(args, state, env)
            self.graphs[key] = cap
        _copy_into(cap.inputs, args)
        cap.graph.replay()
        # The graph rewrites its outputs on every replay: hand the caller its own copy.
        return [o.clone() for o in cap.outputs]


class StageGraphRunner(GraphRunner):
    """A pipeline stage's step as CUDA graphs: the received values are static inputs
    beside the user's, the values to send static outputs beside the user outputs. The
    p2p stays outside the graph (StageRunner posts it between replays): NCCL can capture
    send/recv, but a captured p2p would pin the peers to replaying in lockstep, and
    gloo cannot be captured at all. A batch cut's micro-batches each run on their own
    KV-cache copy, whose addresses a graph bakes in: one graph per (sizes, slot)."""

    def __init__(self, program: Program, max_graphs: int = 16, warmup: int = 2):
        super().__init__(program, max_graphs, warmup)
        self._n_args = len(program.plan.user_inputs)

    def _step(self, prog, static, state, env, arena) -> list[torch.Tensor]:
        outs, sent = prog.run_stage(static[:self._n_args], static[self._n_args:],
                                            state, env, arena=arena)
        return outs + sent

    def run_stage(self, args, received, state, env, slot: int = 0):
        """As Program.run_stage, replayed: (user outputs, copies; values to send, the
        graph's own buffers, valid until its next replay)."""
        static = list(args) + list(received)
        key = self._key(static, env) + (slot,)
        cap = self.graphs.get(key)
        if cap is None:
            if len(self.graphs) >= self.max_graphs:
                return self.program.run_stage(args, received, state, env)
            cap = self._capture(static, state, env)
            self.graphs[key] = cap
        _copy_into(cap.inputs, static)
        cap.graph.replay()
        n_out = len(self.program.plan.outputs)
        return [o.clone() for o in cap.outputs[:n_out]], cap.outputs[n_out:]


def _refuse_size_args(program: Program) -> None:
    """A graph replays the sizes it was captured at; an int size argument's value (a
    decode position) is new on every call, so no captured graph would serve twice."""
    plan = program.plan
    if not plan.size_args:
        return
    names = ", ".join(repr(n) for _, n, _ in plan.size_args)
    raise ArgumentError(
        f"CUDA graphs replay the sizes they were captured at, and this module takes the "
        f"int argument{'s' if len(plan.size_args) > 1 else ''} {names}, a size that changes "
        "from call to call (a decode position): every call would capture a graph of its own",
        where="CompiledModule.cuda_graphs",
        hint="call the module without cuda_graphs(), or pass positions as a tensor (gpt-fast "
        "writes its KV cache with index_copy_(dim, input_pos, k) and slices its mask buffer "
        "with input_pos), so one graph serves every position")


def _copy_into(static: list[torch.Tensor], args: list[torch.Tensor]) -> None:
    """The call's inputs into the graph's own, in one launch: until the replay is queued
    the GPU waits on the host, and each copy_ is ~7 us of it (H200 host, a decode step's
    tokens and positions)."""
    if len(static) > 1:
        torch._foreach_copy_(static, args)
    elif static:
        static[0].copy_(args[0])


def _state_targets(program: Program) -> set[str]:
    return {v.target for v in program.plan.values.values() if v.role == Role.STATE}


def idempotent(program: Program) -> bool:
    """Does running the same call twice leave the state as running it once does?

    True when every state update is an in-place scatter that reads its state only as
    the destination (a KV-cache write); a functional copy-back or a read of the old
    state could compound.
    """
    plan = program.plan
    if plan.state_writes:
        return False
    states = {v.name for v in plan.values.values() if v.role == Role.STATE}
    for r in plan.regions:
        for op in r.ops:
            for i, a in enumerate(op.args):
                refs = [a] if isinstance(a, Ref) else [x for x in _flat(a) if isinstance(x, Ref)]
                for ref in refs:
                    if ref.name in states and not (i == 0 and op.name in r.inplace):
                        return False
    return True


def _flat(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    else:
        yield x
