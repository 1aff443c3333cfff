"""How a compiled Triton kernel is launched on a GPU, with a few microseconds of host work.

Triton's public path, `compiled_kernel[grid](*args)`, asks the driver for the current
device and stream, builds launch metadata and a closure on every launch: tens of
microseconds a kernel once kiln's own per-launch work is added, which made a 128-token
prefill host-bound (kiln issue 10). kiln launches a Program's kernels one after another
on one stream, so the direct path binds what never changes once (the launcher, the
function handle, the packed metadata), takes the stream its Program read once per call,
and calls the launcher with the signature Triton 3.x's launchers share:
`CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
enter_hook, exit_hook, *args)`.

Where the compiled kernel lacks those attributes (another Triton), or while a launch
hook is set (a profiler such as proton reads the public path's launch metadata),
launches take the public path.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

# A launch: (grid x, y, z, stream, arguments) -> None.
Launch = Callable[[int, int, int, int, list], None]


def _runtime_knobs():
    try:
        from triton import knobs
    except ImportError:  # a Triton before knobs: its hooks live elsewhere, take no risk
        return None
    return knobs.runtime


def hooks_set() -> bool:
    """Is a Triton launch hook set (None, or an empty HookChain in newer Triton, is not)?"""
    rt = _runtime_knobs()
    if rt is None:
        return True
    for hook in (getattr(rt, "launch_enter_hook", None), getattr(rt, "launch_exit_hook", None)):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def direct_entry(ck) -> tuple | None:
    """(launcher, function handle, packed metadata) of CompiledKernel `ck`, its module
    loaded; None where this Triton's CompiledKernel has no such parts."""
    init = getattr(ck, "_init_handles", None)
    if init is None:
        return None
    init()
    parts = tuple(getattr(ck, a, None) for a in ("run", "function", "packed_metadata"))
    return None if any(p is None for p in parts) or not callable(parts[0]) else parts


def public_launch(ck) -> Launch:
    """Triton's own launch path (it reads the current stream itself)."""
    def launch(gx, gy, gz, stream, args):
        ck[gx, gy, gz](*args)

    return launch


def launch_for(ck, dependent: bool = True) -> Launch:
    """The launch to use for CompiledKernel `ck`: direct where possible, else public.

    The direct launch checks for launch hooks at every launch (a profiler may be turned
    on after the kernel was bound) and then takes the public path. A kernel compiled as
    a programmatic dependent (build/grid_dependency.py) launches as one only when
    `dependent`; otherwise as an ordinary kernel (its grid-dependency wait is then a
    no-op)."""
    if not dependent:
        ck = independent(ck)
    entry = direct_entry(ck)
    public = public_launch(ck)
    if entry is None:
        return public
    run, function, packed = entry
    rt = _runtime_knobs()
    if rt is None:
        return public

    def launch(gx, gy, gz, stream, args):
        enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
        if (enter is not None and getattr(enter, "calls", True)) or \
                (leave is not None and getattr(leave, "calls", True)):
            public(gx, gy, gz, stream, args)
            return
        run(gx, gy, gz, stream, function, packed, None, None, None, *args)

    return launch


def independent(ck):
    """`ck` launched the ordinary way: a shallow copy whose launcher has launch_pdl off
    (Triton's launcher reads that flag at every launch); `ck` itself when it is not a
    programmatic dependent or this Triton's launcher has no such flag."""
    meta = getattr(ck, "metadata", None)
    if not getattr(meta, "launch_pdl", False):
        return ck
    init = getattr(ck, "_init_handles", None)
    if init is None:
        return ck
    init()
    run = getattr(ck, "run", None)
    if run is None or not hasattr(run, "launch_pdl"):
        return ck
    plain_run = copy.copy(run)
    plain_run.launch_pdl = False
    plain = copy.copy(ck)
    if isinstance(getattr(type(ck), "run", None), property):  # Triton >= 3.5: over `_run`
        plain._run = plain_run
    else:
        plain.run = plain_run
    return plain


def current_stream(device: torch.device) -> int:
    """The raw current stream of `device`'s current GPU (what Triton's public path launches
    on), read once per Program call; 0 off GPUs."""
    if device.type != "cuda":
        return 0
    index = torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream
