"""The fuzzer's findings and fresh fuzz graphs through every entry point.

Each of tests/fuzz/repros/ (a minimised graph that once crashed kiln, gave a wrong
number or fell back silently) and a batch of freshly generated graphs is compiled,
called at every size and compared with eager, saved, loaded, called again, explained,
and called wrongly; every step is correct or a clean KilnError (contract.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import kiln
from kiln.errors import DTypeError, KilnError, ShapeError
from tests.fuzz.generate import generate
from tests.fuzz.graph import make_args
from tests.fuzz.oracle import Config, check
from tests.no_raw_exceptions.contract import GPU_MODULE_CALL, call_and_compare, refused

REPROS = sorted((Path(__file__).parents[1] / "fuzz" / "repros").glob("repro_*.py"))
FRESH_CPU = range(710000, 710010)  # ~0.5 s each with save/load on 2 cores
FRESH_INTERPRET = range(710016, 710019)


def _load_repro(path: Path):
    spec = importlib.util.spec_from_file_location(f"repro_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sizes_and_dims(repro):
    """The repro's call sizes and dynamic_shapes, as its own main() makes them."""
    if repro.DYN is None:
        return [None], None
    d = kiln.Dim("D", min=repro.DYN[0], max=repro.DYN[1])
    dyn = tuple({i: d for i, s in enumerate(shape) if s == "D"} or None
                for shape, _, _ in repro.INPUTS)
    return [repro.DYN[2], *repro.DYN[3]], dyn


def wrong_calls(args: tuple, dyn_max: int | None = None):
    """(what, args, the error a guard must raise): calls a compiled module refuses."""
    yield "one argument too few", args[:-1], KilnError
    yield "one argument too many", (*args, args[0]), KilnError
    for i, a in enumerate(args):
        other = torch.int64 if a.is_floating_point() else torch.float32
        yield f"argument {i} as {other}", _swap(args, i, a.to(other)), DTypeError
        yield f"argument {i} with an extra dim", _swap(args, i, a[None]), ShapeError
        yield f"argument {i} as a str", _swap(args, i, "x"), KilnError
        yield f"argument {i} as a list", _swap(args, i, a.tolist()), KilnError
    if dyn_max is not None:
        yield "a dynamic size past its bound", None, ShapeError


def _swap(args: tuple, i: int, value) -> tuple:
    return (*args[:i], value, *args[i + 1:])


def _check_wrong_calls(exe, args: tuple, too_big: tuple | None = None) -> None:
    for what, bad, cls in wrong_calls(args, None if too_big is None else 1):
        bad = too_big if bad is None else bad
        if exe.target.is_gpu:  # compiled for a GPU: see contract.GPU_MODULE_CALL
            cls = GPU_MODULE_CALL
        refused(lambda bad=bad: exe(*bad), cls, what=what)


@pytest.mark.parametrize("path", REPROS, ids=lambda p: p.stem.removeprefix("repro_"))
def test_repro_through_every_entry_point(path, tmp_path):
    repro = _load_repro(path)
    model = repro.Fuzzed().eval()
    sizes, dyn = _sizes_and_dims(repro)
    example = repro.make_args(sizes[0], 0)
    # every class the repros stand for is fixed: each compiles (a refusal would be a
    # regression to a less capable kiln, even though it would be a clean error)
    exe = kiln.compile(model, example, dynamic_shapes=dyn, target=repro.TARGET,
                       options=repro.OPTIONS)
    compile_only = repro.TARGET.startswith(("cuda", "rocm"))
    if compile_only:
        refused(lambda: exe(*example), GPU_MODULE_CALL)
    else:
        for call, size in enumerate(sizes):
            call_and_compare(exe, model, repro.make_args(size, call))
    exe.save(tmp_path / "repro.kiln")
    loaded = kiln.load(tmp_path / "repro.kiln")
    if not compile_only:
        call_and_compare(loaded, model, example)
    for m in (exe, loaded):
        assert "regions" in m.explain(kernels=True).lower()
    too_big = None if repro.DYN is None else repro.make_args(repro.DYN[1] + 1, 0)
    _check_wrong_calls(loaded, example, too_big)


def _recording_compile(made: list):
    def compile_fn(model, args, **kw):
        made.append(kiln.compile(model, args, **kw))
        return made[-1]
    return compile_fn


@pytest.mark.parametrize("target,seed", [("cpu", s) for s in FRESH_CPU]
                         + [("interpret", s) for s in FRESH_INTERPRET])
def test_fresh_fuzz_graph_through_every_entry_point(target, seed):
    """compile, every call size against eager (float64-checked), save/load and the
    loaded module's calls: the fuzzer's own oracle; then explain and wrong calls."""
    spec = generate(seed)
    made = []
    result = check(spec, Config(targets=(target,), save_load=target == "cpu",
                                compile_fn=_recording_compile(made)))
    worst = result.worst
    assert worst.cls in ("ok", "refused"), f"seed {seed}: {worst.signature}\n{worst.detail}"
    if worst.cls == "refused":
        return
    exe = made[0]
    assert exe.explain(kernels=True)
    args = make_args(spec, spec.call_sizes()[0], 0)
    too_big = None if spec.dyn is None else make_args(spec, spec.dyn[1] + 1, 0)
    _check_wrong_calls(exe, args, too_big)
