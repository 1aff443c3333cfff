"""Run one graph through kiln and classify what happened.

Classes, worst first: crash (an exception that is not a clean KilnError, a
VerifierError, or a KilnError raised by a call in the declared ranges), mismatch
(compare.verdict), fallback (a GPU target, compile-only or run on this machine's
GPU, ran a region as torch ops because none of its Triton configs compiled), refused
(a clean KilnError at compile: fine), ok. Each non-ok outcome has a signature, stable
across graphs and runs, that names the failure class: exception type plus its
normalised first line, or the mismatch kind plus the graph's op set.
"""

from __future__ import annotations

import copy
import re
import tempfile
import traceback
import warnings
from dataclasses import dataclass, field

import torch

import kiln
from kiln.errors import KilnError, VerifierError
from tests.fuzz.compare import perturbed, verdict
from tests.fuzz.graph import (
    FLOATS,
    GraphSpec,
    build_module,
    dynamic_shapes,
    make_args,
)

RANK = {"crash": 4, "mismatch": 3, "fallback": 2, "refused": 1, "ok": 0}


@dataclass
class Outcome:
    cls: str
    target: str = ""
    stage: str = ""
    detail: str = ""
    signature: str = ""


@dataclass
class GraphResult:
    seed: int
    ops: list[str]
    outcomes: list[Outcome] = field(default_factory=list)
    aten: set[str] = field(default_factory=set)  # the ops kiln's plan ran (coverage)

    @property
    def worst(self) -> Outcome:
        return max(self.outcomes, key=lambda o: RANK[o.cls], default=Outcome("ok"))


@dataclass
class Config:
    targets: tuple[str, ...] = ("cpu",)
    gpu: tuple[str, ...] = ()  # compile-only targets, e.g. "cuda:sm_90"
    save_load: bool = False
    compile_fn: object = None  # kiln.compile, or a stand-in (the fuzzer's own tests)


def normalise(msg: str) -> str:
    """An exception message's first line with the graph-specific parts (names, numbers,
    paths) blanked, so the same bug met in two graphs has the same signature."""
    line = next((s.strip() for s in msg.splitlines() if s.strip()), "")
    line = re.sub(r"(/[\w.\-]+)+\.py", "FILE", line)
    line = re.sub(r"\b(?:[vxpbrs]|buf|arg|primals|getitem|_tensor_constant)_?\d+\b", "#", line)
    line = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", line)
    return line[:160]


def _exc_outcome(e: BaseException, target: str, stage: str, compiled: bool) -> Outcome:
    kind = type(e).__name__
    first = normalise(str(e))
    detail = f"{kind}: {str(e)[:2000]}"
    if isinstance(e, KilnError) and not isinstance(e, VerifierError) and not compiled:
        return Outcome("refused", target, stage, detail, f"refused|{kind}|{first}")
    tb = "".join(traceback.format_exception(e)[-6:])
    return Outcome("crash", target, stage, detail + "\n" + tb,
                   f"crash|{target}|{stage.split('@')[0]}|{kind}|{first}")


def _compile(cfg: Config, model, args, spec, target, options=None):
    fn = cfg.compile_fn or kiln.compile
    return fn(model, args, dynamic_shapes=dynamic_shapes(spec), target=target,
              options=options)


class Reference:
    """The float64 reference of one call, computed only when a comparison needs it."""

    def __init__(self, spec: GraphSpec, state: dict, args: tuple):
        self.spec, self.state, self.args = spec, state, args
        self._cache = None

    def __call__(self, index: int):
        if self._cache is None:
            eps = 1e-3 if _has_low_precision(self.spec) else 1e-6
            runs = [self._run(self.args)] + [self._run(perturbed(self.args, eps, s))
                                             for s in (1, 2)]
            self._cache = runs
        base, *near = self._cache
        return base[index], [n[index] for n in near]

    def _run(self, args):
        model = build_module(self.spec, f64=True)
        model.load_state_dict(self.state)
        args64 = tuple(a.double() if a.is_floating_point() else a for a in args)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # int -> float ops (atan of an int) too
        try:
            with torch.no_grad():
                outs = list(model(*args64))
        finally:
            torch.set_default_dtype(default)
        return outs + [b.detach().clone() for _, b in model.named_buffers()]


def _has_low_precision(spec: GraphSpec) -> bool:
    leaves = spec.inputs + spec.params + spec.buffers
    return any(t.dtype in ("f16", "bf16") for t in leaves) or any(
        n.p.get("dt") in ("f16", "bf16") for n in spec.nodes)


def _restore(tensors: dict, state: dict) -> None:
    for name, t in tensors.items():
        if name in state:
            t.copy_(state[name])


def _compare(spec, model, state, run, target, stage) -> Outcome | None:
    """Call `run(args)` (kiln) and the eager model at every call size; the first mismatch."""
    buffer_names = [n for n, _ in model.named_buffers()]
    for i, size in enumerate(spec.call_sizes()):
        args = make_args(spec, size, i)
        _restore(dict(model.named_buffers()), state)
        with torch.no_grad():
            eager = list(model(*args))
        eager += [b.detach().clone() for _, b in model.named_buffers()]
        _restore(dict(model.named_buffers()), state)
        try:
            outs, kiln_state = run(args)
        except Exception as e:  # noqa: BLE001 - every exception is a finding here
            return _exc_outcome(e, target, f"{stage}@{size}", compiled=True)
        outs = list(outs) + [kiln_state[n] for n in buffer_names]
        if len(outs) != len(eager):
            return Outcome("mismatch", target, stage, f"{len(outs)} outputs vs {len(eager)}",
                           f"mismatch|{target}|arity|{'+'.join(spec.ops())}")
        ref = Reference(spec, state, args)
        for j, (o, e) in enumerate(zip(outs, eager)):
            bad, detail = verdict(o, e, lambda j=j, ref=ref: ref(j))
            if bad:
                what = "state" if j >= len(outs) - len(buffer_names) else "values"
                kind = detail.split()[0] if detail.startswith(("dtype", "shape")) else what
                return Outcome("mismatch", target, f"{stage}@{size}",
                               f"call {i} at size {size}, output {j}: {detail}",
                               f"mismatch|{target}|{kind}|{'+'.join(spec.ops())}")
    return None


def on_device(target: str) -> bool:
    """A GPU target that runs here ("cuda", "cuda:0"), not a compile-only one ("cuda:sm_90")."""
    return target.startswith(("cuda", "rocm")) and ":sm_" not in target \
        and ":gfx" not in target


def _runner(exe, state, device: str | None = None):
    """Call the compiled graph; on a GPU target its inputs go to the device and its
    outputs and state come back, so they compare with eager on the CPU."""
    def run(args):
        _restore(exe.state, state)
        if device is not None:
            args = tuple(a.to(device) for a in args)
        out = exe(*args)
        out = out if isinstance(out, (tuple, list)) else (out,)
        if device is None:
            return out, exe.state
        return [o.cpu() for o in out], {n: t.cpu() for n, t in exe.state.items()}
    return run


def check(spec: GraphSpec, cfg: Config) -> GraphResult:
    result = GraphResult(spec.seed, spec.ops())
    model = build_module(spec)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    example = make_args(spec, spec.call_sizes()[0], 0)
    for target in cfg.targets:
        result.outcomes.append(_check_target(spec, cfg, model, state, example, target,
                                             result.aten))
        _restore(dict(model.named_buffers()), state)
    for target in cfg.gpu:
        result.outcomes.append(_check_gpu(spec, cfg, model, example, target))
        _restore(dict(model.named_buffers()), state)
    return result


def _check_target(spec, cfg, model, state, example, target, aten: set) -> Outcome:
    """Compile for `target` and compare every call with eager. On a GPU that runs here
    the generated kernels are forced (tune "none": no extern candidate can win the
    race and hide a wrong kernel), and a region left to torch ops is a finding."""
    device = target if on_device(target) else None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            args = tuple(a.to(device) for a in example) if device else example
            where = copy.deepcopy(model).to(device) if device else model  # as users do
            exe = _compile(cfg, where, args, spec, target,
                           options={"tune": "none"} if device else None)
    except Exception as e:  # noqa: BLE001
        return _exc_outcome(e, target, "compile", compiled=False)
    plan = getattr(exe, "plan", None)
    aten.update(op.target for r in getattr(plan, "regions", ()) for op in r.ops)
    _restore(dict(model.named_buffers()), state)
    bad = _compare(spec, model, state, _runner(exe, state, device), target, "call")
    if bad is None and device is not None:
        bad = _fallback(exe, caught, target)
    if bad is not None or not cfg.save_load:
        return bad or Outcome("ok", target)
    with tempfile.TemporaryDirectory(prefix="kiln-fuzz-") as d:
        try:
            exe.save(d + "/graph.kiln")
            loaded = kiln.load(d + "/graph.kiln")
        except Exception as e:  # noqa: BLE001 - saving what compiled must work
            return _exc_outcome(e, target, "save-load", compiled=True)
        bad = _compare(spec, model, state, _runner(loaded, state, device), target, "loaded")
    return bad or Outcome("ok", target)


def _check_gpu(spec, cfg, model, example, target) -> Outcome:
    """Compile only (no GPU here): a region that fell back to torch ops is a finding."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exe = _compile(cfg, model, example, spec, target, options={"tune": "none"})
    except Exception as e:  # noqa: BLE001
        return _exc_outcome(e, target, "compile", compiled=False)
    return _fallback(exe, caught, target) or Outcome("ok", target)


def _fallback(exe, caught, target) -> Outcome | None:
    """A region that ran as torch ops because its Triton configs failed, if any."""
    from kiln.codegen.autotune.tuner import TuningWarning

    for r in exe.plan.regions:
        for note in r.notes:
            if note.startswith("extern:") and ("template declines" in note
                                               or "generates no kernel" in note):
                continue  # a deliberate extern, not a failure
            if note.startswith("extern"):
                return Outcome("fallback", target, "compile", f"{r.name} ({r.kind}): {note}",
                               f"fallback|{target}|{r.kind}|{normalise(_reason(note))}")
    for w in caught:
        if issubclass(w.category, TuningWarning):
            msg = str(w.message)
            return Outcome("fallback", target, "compile", msg,
                           f"fallback|{target}|warning|{normalise(_reason(msg))}")
    return None


def _reason(note: str) -> str:
    """The first failure reason in a tuner note ('... [cfg] crashed: why; ...')."""
    m = re.search(r"\]\s*([\w-]+):\s*([^;]*)", note)
    return f"{m.group(1)}: {m.group(2)}" if m else note


__all__ = ["check", "Config", "GraphResult", "Outcome", "normalise", "FLOATS"]
