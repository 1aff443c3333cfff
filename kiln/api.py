"""kiln.compile and kiln.load: the pipeline behind the public API.

`kiln.compile(model, args, kwargs=None, dynamic_shapes=None, target="cpu")` feels
like torch.export + torch.compile: it returns a callable that takes and returns
what the model does. `compile_to=<stage>` returns that stage's IR instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from kiln.codegen.select_kernels import select_kernels
from kiln.dispatch.form_regions import form_regions
from kiln.dispatch.reinplace import reinplace
from kiln.errors import ArgumentError, TargetError
from kiln.explain import dim_names, explain
from kiln.frontend.export import import_model
from kiln.graph import GRAPH_PASSES
from kiln.ir.graph import KilnGraph
from kiln.parallel.assign_devices import assign_devices
from kiln.pipeline import Context, Pass, PassManager, Stage
from kiln.runtime.guards import bind_symbols
from kiln.runtime.program import Program
from kiln.runtime.schedule import schedule
from kiln.target import Target, get_target


@dataclass
class ModelSource:
    """The import stage's input: what the user handed to kiln.compile."""

    model: torch.nn.Module
    args: tuple
    kwargs: dict
    dynamic_shapes: Any

    def describe(self) -> str:
        return f"model {type(self.model).__name__} with {len(self.args)} args"


def _import(src: ModelSource, ctx: Context) -> KilnGraph:
    kg = import_model(src.model, src.args, src.kwargs, src.dynamic_shapes)
    ctx.options["state"] = kg.state
    return kg


def _example_env(plan, ctx: Context):
    leaves = ctx.options.get("example_leaves")
    if leaves is not None:
        tensors = [x for i, x in enumerate(leaves) if i not in plan.const_args]
        ctx.options["example_env"] = bind_symbols(plan, tensors)
    return plan


def build_pipeline(dump_dir: str | None = None) -> PassManager:
    return PassManager(
        [
            Stage("import", [Pass("export", _import)]),
            Stage("graph", list(GRAPH_PASSES)),
            Stage("parallel", [assign_devices]),
            Stage("dispatch", [form_regions, reinplace, Pass("example_sizes", _example_env)]),
            Stage("codegen", [select_kernels]),
            Stage("schedule", [schedule]),
        ],
        dump_dir=dump_dir,
    )


def compile(  # noqa: A001 - mirrors torch.compile
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    dynamic_shapes=None,
    target: str | Target = "cpu",
    compile_to: str | None = None,
    dump_ir: str | None = None,
    options: dict | None = None,
):
    """Compile `model` for `target`; returns a CompiledModule (or an IR with compile_to)."""
    tgt = get_target(target)
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = dict(kwargs or {})
    ctx = Context(target=tgt, options=dict(options or {}))
    ctx.options["example_leaves"] = pytree.tree_leaves((args, kwargs))
    src = ModelSource(model, args, kwargs, dynamic_shapes)
    result = build_pipeline(dump_ir).run(src, ctx, compile_to=compile_to)
    if not isinstance(result, Program):
        return result
    names = dim_names(model, args, kwargs, dynamic_shapes, result.plan)
    return CompiledModule(result, _state_for(result, ctx.options["state"], tgt),
                          example_sizes=ctx.options.get("example_env"), dim_names=names)


def _device_present(tgt: Target) -> bool:
    return tgt.torch_device != "cuda" or torch.cuda.is_available()


def _state_for(program: Program, named: dict[str, torch.Tensor], tgt: Target):
    """The module's parameters, buffers and constants the plan reads, on the target's device.

    On the model's own device they are shared, not copied (as torch.compile does):
    an 8B model must not need two copies, and buffer updates (the KV cache) are the
    model's own.
    """
    # Compiling for a GPU on a machine without one (compile-only): weights stay put.
    device = torch.device(tgt.torch_device if _device_present(tgt) else "cpu")
    state = {}
    for v in program.plan.values.values():
        if v.target is None:
            continue
        t = named.get(v.target)
        if t is None:
            raise ArgumentError(f"the compiled plan reads {v.target}, which the model lacks")
        t = t.detach()
        state[v.target] = t if t.device.type == device.type else t.to(device)
    return state


def _child(spec: pytree.TreeSpec, i: int) -> pytree.TreeSpec:
    """spec's i-th child (TreeSpec.child is new in torch 2.13; children_specs before)."""
    return spec.child(i) if hasattr(spec, "child") else spec.children_specs[i]


class CompiledModule:
    """What kiln.compile returns: call it like the model; save it; explain it."""

    def __init__(self, program: Program, state: dict[str, torch.Tensor],
                 example_sizes: dict[str, int] | None = None,
                 dim_names: dict[str, str] | None = None):
        self.program = program
        self.plan = program.plan
        self.state = state
        self.target = program.kplan.target
        self.example_sizes = dict(example_sizes or {})  # symbol -> size in the example args
        self.dim_names = dict(dim_names or {})  # torch.export.Dim name -> symbol
        self._in_spec = pytree.treespec_loads(self.plan.in_spec)
        self._out_spec = pytree.treespec_loads(self.plan.out_spec)
        self._graphs = None
        self._graph_when = None
        # Most modules take plain positional tensors: those calls skip pytree entirely.
        n = len(self.plan.user_inputs)
        self._flat_in = not self.plan.const_args and self._in_spec == pytree.tree_structure(
            (tuple(range(n)), {}))
        self._out_leaf = self._out_spec.is_leaf()

    def cuda_graphs(self, when=None, max_graphs: int = 16) -> CompiledModule:
        """Replay calls as captured CUDA graphs, one per set of sizes.

        `when(*tensor_args) -> bool` picks the calls that use them (e.g. decode steps:
        `lambda tokens, pos: tokens.shape[-1] == 1`); other calls run normally.
        """
        from kiln.runtime.cuda_graphs import GraphRunner

        self._graphs = GraphRunner(self.program, max_graphs=max_graphs)
        self._graph_when = when
        return self

    def _flatten(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        if (self._flat_in and not kwargs and len(args) == len(self.plan.user_inputs)
                and all(type(a) is torch.Tensor for a in args)):
            return list(args)
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
        return [x for i, x in enumerate(leaves) if i not in self.plan.const_args]

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

    def __call__(self, *args, **kwargs):
        if not _device_present(self.target):
            raise TargetError(
                f"this module was compiled for {self.target}, but torch sees no GPU here",
                hint="compiling for a GPU without one is compile-only: save the module and "
                "load it (kiln.load / kiln run DIR) on a machine with that GPU",
            )
        flat = self._flatten(args, kwargs)
        env = self.program.bind(flat, self.plan.user_inputs)
        with torch.no_grad():
            if self._graphs is not None and (self._graph_when is None or self._graph_when(*flat)):
                outs = self._graphs.run(flat, self.state, env)
            else:
                outs = self.program.run(flat, self.state, env)
        if self._out_leaf:
            return outs[0]
        return pytree.tree_unflatten(outs, self._out_spec)

    def save(self, path) -> None:
        from kiln.artifact.save import save

        save(self, path)

    def describe(self) -> str:
        return self.program.describe()

    def explain(self, kernels: bool = False) -> str:
        """The `kiln explain` report: regions, shapes, bounds, bytes, flops, memory."""
        return explain(self.program, self.example_sizes, self.dim_names, kernels=kernels)

    def __repr__(self) -> str:
        return (f"CompiledModule(target={self.target}, regions={len(self.plan.regions)}, "
                f"inputs={self.plan.user_inputs})")


def load(path, target: str | Target | None = None) -> CompiledModule:
    """Load a module saved with CompiledModule.save, without recompiling."""
    from kiln.artifact.load import load as _load

    art = _load(path, target)
    return CompiledModule(art.program, art.state, art.example_sizes, art.dim_names)
