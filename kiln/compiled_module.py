"""CompiledModule: what kiln.compile and kiln.load return. Call it like the model.

It pairs a runtime Program with the weights it reads, and translates between the
model's calling convention (nested args and kwargs, non-tensor constants) and the
Program's flat tensor list.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from kiln.errors import ArgumentError, KilnError, TargetError
from kiln.explain import explain
from kiln.ir import treespec
from kiln.runtime.distributed import use_groups
from kiln.runtime.program import Program
from kiln.runtime.state import device_present


def _child(spec: pytree.TreeSpec, i: int) -> pytree.TreeSpec:
    """spec's i-th child (TreeSpec.child is new in torch 2.13; children_specs before)."""
    return spec.child(i) if hasattr(spec, "child") else spec.children_specs[i]


class CompiledModule:
    """What kiln.compile returns: call it like the model; save it; explain it.

    `CompiledModule(program, state, example_sizes=...)` builds one from a runtime
    Program and its weights by state-dict name, already on the target's device
    (kiln.runtime.state.state_for_target gives them). `example_sizes` (symbol ->
    size in the example args) lets `explain` report costs at the example's sizes.
    """

    def __init__(self, program: Program, state: dict[str, torch.Tensor], *,
                 example_sizes: dict[str, int] | None = None, parallel=None,
                 weight_slices: dict | None = None,
                 compile_timings: dict[str, float] | None = None):
        self.program = program
        self.plan = program.plan
        self.state = state
        self.target = program.kplan.target
        self.example_sizes = dict(example_sizes or {})
        self.parallel = parallel  # the ParallelConfig of a multi-device plan's rank
        # state name -> (axis, [(start, end), ...]) for the weights this rank holds a
        # slice of: what a loader reads from a checkpoint for this rank
        self.weight_slices = dict(weight_slices or {})
        # seconds by compile phase (kiln.progress.phase); empty for a loaded module
        self.compile_timings = dict(compile_timings or {})
        self._in_spec = treespec.loads(self.plan.in_spec)
        self._out_spec = treespec.loads(self.plan.out_spec)
        self._graphs = None
        self._graph_when = None
        self._stages = None  # a pipeline stage's runner (recv, run, send, broadcast)
        if parallel is not None and parallel.pp > 1:
            from kiln.runtime.stage_runner import StageRunner

            if self.plan.size_args:
                raise ArgumentError(
                    "a pipeline-parallel module binds each micro-batch's sizes from its "
                    "tensors, and this one takes int size arguments ("
                    + ", ".join(repr(n) for _, n, _ in self.plan.size_args) + ")",
                    hint="pass them as tensors (positions: gpt-fast's input_pos), or "
                    "compile with parallel={'pp': 1}")
            self._stages = StageRunner(program, parallel, self._out_spec.num_leaves
                                       - len(self.plan.none_outputs))
        # Most modules take plain positional tensors: those calls skip pytree entirely.
        n = len(self.plan.user_inputs)
        plain = not self.plan.const_args and not self.plan.size_args
        self._size_index = [i for i, _, _ in self.plan.size_args]
        self._flat_in = plain and self._in_spec == pytree.tree_structure(
            (tuple(range(n)), {}))
        # ... or keyword tensors alone (LLM.forward's): the compiled keys, in their order
        self._flat_kw = None
        if plain and self._in_spec.num_children == 2:
            keys = _child(self._in_spec, 1).context
            if keys is not None and len(keys) == n and self._in_spec == pytree.tree_structure(
                    ((), dict.fromkeys(keys, 0))):
                self._flat_kw = tuple(keys)
        self._out_leaf = self._out_spec.is_leaf()
        self._none_outputs = sorted(self.plan.none_outputs)  # Nones forward returns

    @property
    def dim_names(self) -> dict[str, str]:
        """torch.export.Dim name -> size symbol (e.g. {"seq": "s17"})."""
        return {name: sym for sym, name in self.plan.dim_names.items()}

    def cuda_graphs(self, when=None, max_graphs: int = 16) -> CompiledModule:
        """Replay calls as captured CUDA graphs, one per set of sizes.

        `when(*tensor_args) -> bool` picks the calls that use them (e.g. decode steps:
        `lambda tokens, pos: tokens.shape[-1] == 1`); other calls run normally.
        """
        from kiln.runtime.cuda_graphs import GraphRunner, StageGraphRunner

        if self._stages is not None:
            if when is not None:
                raise ArgumentError(
                    "a pipeline stage replays every call's steps as CUDA graphs; when= "
                    "would let the ranks of one call disagree",
                    hint="call cuda_graphs() without when= on a pipeline-parallel module")
            self._stages.graphs = StageGraphRunner(self.program, max_graphs=max_graphs)
            return self
        self._graphs = GraphRunner(self.program, max_graphs=max_graphs)
        self._graph_when = when
        return self

    def micro_batches(self, count: int, split: str = "batch",
                      dim: str | None = None) -> CompiledModule:
        """Pipeline each later call as `count` micro-batches (GPipe): stage s runs
        micro-batch m while stage s+1 runs m-1. `split="batch"` cuts the rows (prefill
        and decode; each micro-batch keeps its own KV-cache copy on every stage);
        `split="sequence"` cuts a causal prefill into chunks through the one cache.
        `dim` names the torch.export.Dim to cut (default: dim 0, or dim 1 for
        "sequence", of the first argument). Every rank calls it with the same values.
        A batch cut's cache copies are made when the number of slots changes (the
        copies start as the module's cache): change the cut between batches, not
        within one. See kiln/runtime/micro_batches.py."""
        if self._stages is None:
            raise ArgumentError("micro-batches pipeline the stages of a pipeline-parallel "
                                "module, and this one runs whole on one stage",
                                hint="compile with parallel={'pp': P} (P > 1) to use them")
        self._stages.configure(count, split, dim)
        return self

    @property
    def pipeline_timeline(self) -> list:
        """The last call's steps on this stage: (stage, micro_batch, start, end)."""
        return list(self._stages.timeline) if self._stages is not None else []

    def _flatten(self, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list]:
        """The call's tensor leaves, and its dynamic int arguments (plan.size_args)."""
        if (self._flat_in and not kwargs and len(args) == len(self.plan.user_inputs)
                and all(type(a) is torch.Tensor for a in args)):
            return list(args), []
        keys = self._flat_kw
        if (keys is not None and not args and len(kwargs) == len(keys)
                and all(type(kwargs.get(k)) is torch.Tensor for k in keys)):
            return [kwargs[k] for k in keys], []
        kw_spec = _child(self._in_spec, 1) if self._in_spec.num_children == 2 else None
        if kw_spec is not None and kw_spec.context is not None:
            keys = list(kw_spec.context)
            extra = set(kwargs) - set(keys)
            missing = set(keys) - set(kwargs)
            if extra or missing:
                raise ArgumentError(
                    f"keyword arguments differ from the compiled ones: "
                    f"unexpected {sorted(extra)}, missing {sorted(missing)}",
                    hint=f"the module was compiled with keywords {keys}",
                )
            kwargs = {k: kwargs[k] for k in keys}
        leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
        if spec != self._in_spec:
            self._explain_mismatch(args)
        for i, want in self.plan.const_args.items():
            if leaves[i] != want:
                raise ArgumentError(
                    f"non-tensor argument {i} is {leaves[i]!r}, the module was compiled for "
                    f"{want!r}",
                    hint="export specialises non-tensor arguments: recompile for the new value",
                )
        sizes = [leaves[i] for i in self._size_index]
        skip = set(self.plan.const_args) | set(self._size_index)
        return [x for i, x in enumerate(leaves) if i not in skip], sizes

    def _explain_mismatch(self, args: tuple):
        want = _child(self._in_spec, 0)
        if len(args) != want.num_children:
            raise ArgumentError(
                f"the compiled module takes {want.num_children} positional arguments, "
                f"got {len(args)}",
                hint="call it with the same arguments as the example args",
            )
        for i, a in enumerate(args):
            spec_i = _child(want, i)
            if pytree.tree_flatten(a)[1] != spec_i:
                expected = "a tensor" if spec_i.is_leaf() else f"a {spec_i.type.__name__}"
                raise ArgumentError(
                    f"positional argument {i} must be {expected}, got {type(a).__name__}",
                    hint="call with the same arguments (and nesting) as the example args",
                )
        raise ArgumentError("the keyword arguments' structure differs from the compiled one")

    def accepts(self, *args, **kwargs) -> bool:
        """Whether a call with these arguments passes this module's checks (structure,
        non-tensor values, dtypes, devices, sizes within their bounds), without running
        it: how a lazily compiled module (kiln/lazy_module.py) finds one for a new call."""
        try:
            flat, sizes = self._flatten(args, kwargs)
            self.program.bind(flat, self.plan.user_inputs, sizes)
        except KilnError:
            return False
        return True

    def __call__(self, *args, **kwargs):
        if not device_present(self.target):
            raise TargetError(
                f"this module was compiled for {self.target}, but torch sees no GPU here",
                hint="compiling for a GPU without one is compile-only: save the module and "
                "load it (kiln.load / kiln run DIR) on a machine with that GPU",
            )
        flat, sizes = self._flatten(args, kwargs)
        if self.parallel is not None:
            use_groups(self.parallel.tp, self.parallel.pp)
        # a pipeline stage binds each micro-batch's sizes itself
        env = None if self._stages is not None else self.program.bind(
            flat, self.plan.user_inputs, sizes)
        grad = torch.is_grad_enabled()  # torch.no_grad(), without its context objects
        if grad:
            torch._C._set_grad_enabled(False)
        try:
            if self._stages is not None:
                outs = self._stages.run(flat, self.state)
            elif self._graphs is not None and (self._graph_when is None or self._graph_when(*flat)):
                outs = self._graphs.run(flat, self.state, env)
            else:  # the narrow version at its sizes (runtime/program.py)
                outs = self.program.for_sizes(env).run(flat, self.state, env)
        finally:
            if grad:
                torch._C._set_grad_enabled(True)
        if self._out_leaf:
            return None if self._none_outputs else outs[0]
        if self._none_outputs:
            outs = list(outs)
            for i in self._none_outputs:
                outs.insert(i, None)
        return pytree.tree_unflatten(outs, self._out_spec)

    def save(self, path) -> None:
        """Write the module to `path`; each rank of a multi-device plan saves its part."""
        from kiln.artifact.ranks import rank_dir, write_parallel_manifest
        from kiln.artifact.save import save

        if self.parallel is None or self.parallel.world_size == 1:
            save(self, path)
            return
        save(self, rank_dir(path, self.parallel.rank))
        if self.parallel.rank == 0:
            write_parallel_manifest(path, self.parallel.tp, self.parallel.pp)

    def describe(self) -> str:
        return self.program.describe()

    def explain(self, kernels: bool = False, timings: bool = False) -> str:
        """The `kiln explain` report: regions, shapes, bounds, bytes, flops, memory;
        `timings=True` adds where the compile's time went (compile_timings)."""
        return explain(self.program, self.example_sizes, kernels=kernels,
                       parallel=self.parallel,
                       timings=self.compile_timings if timings else None)

    def __repr__(self) -> str:
        return (f"CompiledModule(target={self.target}, regions={len(self.plan.regions)}, "
                f"inputs={self.plan.user_inputs})")
