"""The contract every public entry point keeps: a correct result, or a clean KilnError.

Clean means a KilnError subclass that is the user's to fix: not a VerifierError or a
message saying "kiln bug" (those are kiln's own failures, however politely worded).
Anything else (TypeError, RuntimeError, AttributeError, ...) propagates out of these
helpers, so pytest shows the raw traceback that escaped kiln.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils._pytree as pytree

from kiln.errors import KilnError, TargetError, VerifierError
from tests.fuzz.compare import verdict

# Without a GPU, a module compiled for one refuses every call (TargetError); with one,
# a call with CPU tensors is the caller's DeviceError (or an earlier argument check).
NO_GPU = not torch.cuda.is_available()
GPU_MODULE_CALL = TargetError if NO_GPU else KilnError


def _check_clean(e: KilnError) -> KilnError:
    if isinstance(e, VerifierError) or "kiln bug" in str(e):
        pytest.fail(f"kiln's own failure, not the user's: {type(e).__name__}: {e}")
    assert e.what.strip(), f"{type(e).__name__} says nothing"
    return e


def kiln_error_or(fn):
    """fn()'s value, or None when it raised a clean KilnError."""
    try:
        return fn()
    except KilnError as e:
        _check_clean(e)
        return None


def refused(fn, cls=KilnError, match: str | None = None, what: str = "") -> KilnError:
    """fn() must raise a clean KilnError of `cls` (a class or a tuple of them) whose text
    contains `match`."""
    what = what or "the call"
    name = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
    try:
        value = fn()
    except KilnError as e:
        _check_clean(e)
        assert isinstance(e, cls), \
            f"{what}: expected {name}, got {type(e).__name__}: {e}"
        assert match is None or match in str(e), f"{what}: {match!r} not in: {e}"
        return e
    pytest.fail(f"{what} was accepted (gave {type(value).__name__}), expected {name}")


def float64_reference(model: torch.nn.Module, args: tuple) -> list:
    """The model's outputs, then its buffers, with its weights and float inputs in
    float64 (a cast to a low precision inside the graph stays one)."""
    m64 = copy.deepcopy(model).double()
    a64 = pytree.tree_map(lambda t: t.double() if isinstance(t, torch.Tensor)
                          and t.is_floating_point() else t, args)
    with torch.no_grad():
        outs = pytree.tree_leaves(m64(*a64))
    return outs + [b for _, b in m64.named_buffers()]


def call_and_compare(exe, model: torch.nn.Module, args: tuple) -> None:
    """Call `exe` (compiled from `model`) from the model's state and check its outputs,
    and the buffers it updates, against eager from the same state: within the
    tolerance, or (the fuzzer's verdict, compare.py) no further from the float64
    reference than rounding explains. `model` itself is left as it was."""
    eager_model = copy.deepcopy(model)  # first: a compiled module may share its buffers
    reference_model = copy.deepcopy(model)
    state = {n: b.detach().clone() for n, b in model.named_buffers()}
    for name, t in exe.state.items():
        if name in state:
            t.copy_(state[name])
    outs = pytree.tree_leaves(exe(*args))
    outs += [exe.state[n].cpu() for n in state]
    with torch.no_grad():
        refs = pytree.tree_leaves(eager_model(*args))
    refs += [b for _, b in eager_model.named_buffers()]
    assert len(outs) == len(refs), f"{len(outs)} outputs and buffers, eager has {len(refs)}"
    f64 = None
    for i, (o, r) in enumerate(zip(outs, refs)):
        if not isinstance(r, torch.Tensor):
            assert o == r, f"output {i}: {o!r} vs eager {r!r}"
            continue

        def reference(i=i):
            nonlocal f64
            if f64 is None:
                f64 = float64_reference(reference_model, args)
            return f64[i], []

        bad, detail = verdict(o.detach().cpu(), r.detach().cpu(), reference)
        assert not bad, f"output {i}: {detail}"
