"""kiln.compile and kiln.load: the pipeline behind the public API.

`kiln.compile(model, args, kwargs=None, dynamic_shapes=None, target="cpu")` feels
like torch.export + torch.compile: it returns a callable that takes and returns
what the model does; without args, a LazyModule that compiles on its first call.
`compile_to=<stage>` returns that stage's IR instead. Each pass lives in its stage's
package; this module only puts them in order.
kiln.load reads back what CompiledModule.save wrote; kiln.save_modules and
kiln.load_modules do the same for modules that share weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator

import torch
import torch.utils._pytree as pytree

from kiln.arguments import (
    check_device_map,
    check_dump_dir,
    check_fallback,
    check_kwargs,
    check_lazy,
    check_options,
    check_pins,
    check_stray_keywords,
)
from kiln.artifact import compile_cache
from kiln.codegen.autotune.tuner import start_workers, workers_released_on_failure
from kiln.codegen.autotune.worker_pool import run_worker_kept
from kiln.codegen.select_kernels import select_kernels
from kiln.compiled_module import CompiledModule
from kiln.dispatch.example_sizes import bind_example_sizes
from kiln.dispatch.fold_cache_writes import fold_cache_writes
from kiln.dispatch.fold_delta_state import fold_delta_state
from kiln.dispatch.fold_delta_step import fold_delta_step
from kiln.dispatch.fold_fp8_prologue import fold_fp8_prologue
from kiln.dispatch.fold_query_norm import fold_query_norm
from kiln.dispatch.fold_rmsnorm import fold_rmsnorm
from kiln.dispatch.fold_topk_sum import fold_topk_sum
from kiln.dispatch.form_regions import form_regions
from kiln.dispatch.group_cache_writes import group_cache_writes
from kiln.dispatch.group_fp8_siblings import group_fp8_siblings
from kiln.dispatch.group_siblings import group_siblings
from kiln.dispatch.mask_envelope import mask_envelope
from kiln.dispatch.narrow_rows import narrow_bound
from kiln.dispatch.recompute_cheap import recompute_cheap
from kiln.dispatch.reinplace import reinplace
from kiln.dispatch.split_attention_prologues import split_attention_prologues
from kiln.errors import KilnError, KilnWarning
from kiln.frontend.export import capture, fallback_warning
from kiln.frontend.import_pass import ModelSource, import_pass
from kiln.frontend.module_identity import module_identity, module_state
from kiln.graph import GRAPH_PASSES
from kiln.ir.symbolic import Bounds
from kiln.lazy_module import MAX_MODULES, LazyModule
from kiln.parallel.assign_devices import assign_devices
from kiln.parallel.config import parse_parallel
from kiln.parallel.pipeline_stages import pipeline_stages
from kiln.parallel.seeds import collect_seeds
from kiln.parallel.tensor_parallel import tensor_parallel
from kiln.pipeline import Context, PassManager, Stage
from kiln.progress import phase, recording
from kiln.runtime.distributed import join_world
from kiln.runtime.program import NarrowVersion, Program
from kiln.runtime.schedule import schedule
from kiln.runtime.state import state_for_target
from kiln.settings import setup_logging
from kiln.target import Target, get_target


def build_pipeline(dump_dir: str | None = None) -> PassManager:
    return PassManager(
        [
            Stage("import", [import_pass]),
            Stage("graph", list(GRAPH_PASSES)),
            Stage("parallel", [pipeline_stages, tensor_parallel, assign_devices]),
            Stage("dispatch", [form_regions, fold_rmsnorm, fold_query_norm, fold_topk_sum,
                               fold_delta_step,
                               group_siblings, group_fp8_siblings, fold_fp8_prologue,
                               mask_envelope,
                               split_attention_prologues, reinplace, fold_delta_state,
                               group_cache_writes, fold_cache_writes, recompute_cheap,
                               bind_example_sizes]),
            Stage("codegen", [select_kernels]),
            Stage("schedule", [schedule]),
        ],
        dump_dir=dump_dir,
    )


def compile(  # noqa: A001 - mirrors torch.compile
    model: torch.nn.Module,
    args: tuple | None = None,
    kwargs: dict | None = None,
    *,
    dynamic_shapes=None,
    target: str | Target | None = None,
    compile_to: str | None = None,
    dump_ir: str | None = None,
    options: dict | None = None,
    parallel: dict | None = None,
    devices: int | list[int] | None = None,
    device_map: dict[int, int] | None = None,
    pins: dict[str, int] | None = None,
    fallback: str = "allow",
    allow_train: bool = False,
    max_modules: int | None = None,
    **stray,
):
    """Compile `model` for `target` (default "cpu"); returns a CompiledModule (or an IR
    with compile_to).

    Without example args (and kwargs), as torch.compile: a LazyModule that compiles on
    its first call from that call's arguments, for `target` or else their device, and
    again (with a KilnWarning) for a call of another signature, up to `max_modules`
    (default 8) modules; kiln/lazy_module.py says how. Every other keyword is passed on;
    one kiln.compile does not take is an ArgumentError (the model's go in `kwargs`).

    `parallel={"tp": T, "pp": P}` compiles this process's part of a T x P plan: every
    rank (torchrun's RANK, or `"rank"` in the dict) calls compile with the same model.
    `devices` declares the devices the plan may use (a count or indices; by default its
    ranks) and `device_map` puts logical devices (ranks, `cuda:N` in the model's code)
    onto declared ones; a device needed but not declared is a DeviceError. `pins`
    ({state name: device}) names a weight's home device; a weight read on other devices
    is cloned to them. An op kiln has no kernel for runs as PyTorch's own op (a
    KilnWarning names each); `fallback="error"` refuses them instead, all listed at once.
    A model whose train mode changes what it computes (dropout, batch statistics) is
    refused unless `allow_train=True`: kiln compiles for inference.
    """
    check_stray_keywords(stray)
    lazy = args is None and kwargs is None
    check_lazy(lazy, compile_to, dump_ir, max_modules)
    kw = dict(dynamic_shapes=dynamic_shapes, compile_to=compile_to, dump_ir=dump_ir,
              options=options, parallel=parallel, devices=devices, device_map=device_map,
              pins=pins, fallback=fallback, allow_train=allow_train)
    if not lazy:
        return _compile_now(model, args, kwargs, target="cpu" if target is None else target, **kw)
    if target is not None:  # mistakes found now, not at the first call
        get_target(target)
    check_options(options)
    check_fallback(fallback)
    return LazyModule(model, _compile_now, target, max_modules or MAX_MODULES, kw)


def _dense_examples(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example tensors made contiguous. torch.export guards on an example's strides
    (a slice `ids[:, :5]` of a wider tensor gave `T != 1` for its dynamic dim, refused
    as the user's Dim), while kiln's modules take any layout: each input is made dense
    at call time, so the example's strides only ever constrained the sizes."""
    def dense(t: torch.Tensor) -> torch.Tensor:
        return t if t.is_contiguous() else t.contiguous()
    return pytree.tree_map_only(torch.Tensor, dense, (args, kwargs))


@contextlib.contextmanager
def compile_session() -> Iterator[None]:
    """kiln.compile calls inside share the autotuner's run worker (the process, with a
    CUDA context of its own, that times candidates on the GPU): it is stopped when the
    session ends instead of after each compile. Compile a model's modules (prefill and
    decode) in one session: each compile after the first would otherwise wait for a
    fresh worker (~8 s on an H200 machine) before its first timing. Its GPU memory
    (at most ~5% of the GPU, cached between timings) is freed when the session ends."""
    with run_worker_kept():
        yield


def _compile_now(model, args, kwargs, **kw):
    """kiln.compile with example args: the pipeline, run now (or the compile cache's hit).
    A compile that fails stops the tuner's workers it started. The plan and its narrow
    version share one run worker."""
    with workers_released_on_failure(), run_worker_kept():
        return _compile_started(model, args, kwargs, **kw)


def _compile_started(model, args, kwargs, *, dynamic_shapes, target, compile_to, dump_ir,
                     options, parallel, devices, device_map, pins, fallback, allow_train):
    setup_logging()
    tgt = get_target(target)
    args = () if args is None else tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = check_kwargs(kwargs)
    args, kwargs = _dense_examples(args, kwargs)
    check_fallback(fallback)
    check_dump_dir(dump_ir)
    ctx = Context(target=tgt, options=check_options(options))
    ctx.options["fallback"] = fallback
    ctx.options["allow_train"] = allow_train
    ctx.options["parallel"] = cfg = parse_parallel(parallel, rank=_world_rank())
    if devices is not None:
        ctx.options["devices"] = devices
    if device_map is not None:
        ctx.options["device_map"] = check_device_map(device_map)
    if pins is not None:
        ctx.options["pins"] = check_pins(pins)
    if cfg.tp > 1:
        ctx.options["tp_seeds"] = collect_seeds(model)
    if not cfg.is_single and compile_to is None:
        join_world(cfg.tp, cfg.pp, tgt.torch_device, ctx.options.get("device_map"))
    ctx.options["example_leaves"] = pytree.tree_leaves((args, kwargs))
    src = ModelSource(model, args, kwargs, dynamic_shapes)
    key = captured = by_identity = None
    if compile_cache.usable(ctx.options, cfg, compile_to, dump_ir):
        with recording(ctx.timings):
            with phase("compile_cache"):
                identity = module_identity(model)
            if identity is not None:  # kiln's and torch's modules only: found before export
                with phase("compile_cache"):
                    by_identity = compile_cache.identity_key(
                        identity, tgt, ctx.options, ctx.options["example_leaves"],
                        dynamic_shapes)
                hit = compile_cache.get(by_identity, module_state(model), tgt)
        if by_identity is not None and hit is not None:
            return _cached_module(hit, tgt, ctx)
        if by_identity is not None and cfg.is_single:  # a miss: kernels will be built
            with recording(ctx.timings), phase("workers"):
                start_workers(tgt, ctx.options)
        with recording(ctx.timings), phase("import/export"):
            src.exported = capture(model, args, kwargs, dynamic_shapes, allow_train)
        captured = {**src.exported.state_dict, **src.exported.constants}
        with recording(ctx.timings), phase("compile_cache"):
            key = compile_cache.compile_key(src.exported, tgt, ctx.options,
                                            ctx.options["example_leaves"], dynamic_shapes)
            hit = compile_cache.get(key, captured, tgt)
        if hit is not None:
            if by_identity is not None:
                compile_cache.alias(by_identity, key)
            return _cached_module(hit, tgt, ctx)
    if cfg.is_single:  # (ranks of one host would each start a worker per core)
        with recording(ctx.timings), phase("workers"):
            start_workers(tgt, ctx.options)  # their start-up overlaps export, if still to do
    with warnings.catch_warnings(record=True) as seen:  # re-raised below, as they came
        manager = build_pipeline(dump_ir)
        result = manager.run(src, ctx, compile_to=compile_to)
        if isinstance(result, Program) and cfg.pp == 1:  # a stage binds per micro-batch
            _add_narrow_version(result, manager, ctx)
    for w in seen:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    if ctx.options.get("fallback_ops"):
        # stacklevel: the user's kiln.compile call (compile, then this function)
        warnings.warn(fallback_warning(ctx.options["fallback_ops"]), stacklevel=3)
    if not isinstance(result, Program):
        return result
    if key is not None:
        with recording(ctx.timings):
            compile_cache.put(key, result, ctx.options.get("example_env") or {}, captured,
                              ctx.options, warned=bool(seen))
            if by_identity is not None:
                compile_cache.alias(by_identity, key)
    with recording(ctx.timings), phase("weights"):  # onto the target's device
        state = state_for_target(result, ctx.options["state"], tgt)
    return CompiledModule(result, state, example_sizes=ctx.options.get("example_env"),
                          parallel=None if cfg.is_single else cfg,
                          weight_slices=ctx.options.get("weight_cuts"),
                          compile_timings=ctx.timings)


def _add_narrow_version(program: Program, manager: PassManager, ctx: Context) -> None:
    """Compile the plan again where one dynamic dim's smaller sizes keep its products
    GEMVs (dispatch/narrow_rows.py says which and why): dispatch, codegen and schedule
    run a second time on the parallel stage's graph with that dim's bound narrowed, and
    the program runs the result at those sizes. options={"narrow_version": False}
    compiles one plan for every size."""
    bound = None
    if ctx.options.get("narrow_version", True):
        bound = narrow_bound(program.plan, ctx.target)
    if bound is None:
        return
    graph = manager.stage_ir["parallel"]
    narrowed = dataclasses.replace(graph, symbols={
        **graph.symbols, **dict.fromkeys(bound.symbols, Bounds(bound.lo, bound.hi))})
    # its own options: the passes note what they found (example sizes, ...) in them
    again = Context(target=ctx.target, options=dict(ctx.options), timings=ctx.timings)
    try:
        with recording(ctx.timings), phase("narrow"):
            low = manager.run(narrowed, again, start="dispatch", tag="narrow")
    except KilnError as e:  # the plan for every size stands: the version only speeds up
        name = graph.dim_names.get(bound.symbols[0], bound.symbols[0])
        warnings.warn(KilnWarning(
            f"the plan for {name} <= {bound.hi} (GEMVs) did not compile, so those sizes run "
            f"the plan for every size: {e.what}",
            hint="report it; options={'narrow_version': False} compiles without trying"),
            stacklevel=2)
        return
    program.narrow = NarrowVersion(bound.symbols[0], bound.hi, low)


def _cached_module(hit, tgt: Target, ctx: Context) -> CompiledModule:
    """The CompiledModule of a compile cache hit: its program on the model's weights."""
    program, state, sizes = hit
    with recording(ctx.timings), phase("weights"):
        state = state_for_target(program, state, tgt)
    return CompiledModule(program, state, example_sizes=sizes, compile_timings=ctx.timings)


def _world_rank() -> int | None:
    """This process's rank: the initialised process group's, else torchrun's RANK."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


def load(path, target: str | Target | None = None) -> CompiledModule:
    """Load a module saved with CompiledModule.save, without recompiling."""
    from kiln.artifact.load import load as _load
    from kiln.artifact.ranks import read_parallel_manifest, this_rank

    setup_logging()
    ranks = read_parallel_manifest(path)
    if ranks is None:
        art = _load(path, target)
        return CompiledModule(art.program, art.state, example_sizes=art.example_sizes)
    rank = _world_rank()
    art = _load(this_rank(ranks, rank, path), target)
    cfg = parse_parallel({"tp": ranks["tp"], "pp": ranks["pp"], "rank": rank})
    join_world(cfg.tp, cfg.pp, art.program.kplan.target.torch_device)
    return CompiledModule(art.program, art.state, example_sizes=art.example_sizes,
                          parallel=cfg)


def save_modules(path, modules: dict[str, CompiledModule], *, empty_state: bool = False,
                 files: dict | None = None) -> None:
    """Save compiled modules that share weights (an LLM's prefill and decode) in one
    directory, each shared tensor once; kiln.load_modules gives them back sharing them.

    empty_state=True stores the buffers they update in place (KV caches) as shapes
    only (they load as zeros); `files` (name -> text, bytes or a pathlib.Path to copy)
    are kept beside them.
    """
    from kiln.artifact.group import save_group

    save_group(modules, path, empty_state=empty_state, files=files)


def load_modules(path, target: str | Target | None = None) -> dict[str, CompiledModule]:
    """The modules saved with kiln.save_modules, by name, sharing their tensors again."""
    from kiln.artifact.group import load_group

    setup_logging()
    return {name: CompiledModule(art.program, art.state, example_sizes=art.example_sizes)
            for name, art in load_group(path, target).items()}
