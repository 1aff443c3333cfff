"""The run worker: `python -m kiln.codegen.autotune.run_worker <read-fd> <write-fd>`.

Why (issue 13): a candidate of the attention template read shared memory out of
bounds while it was being timed on an H100; the CUDA error it raised poisons the CUDA
context of the process it ran in, and that was the user's compile. Here candidates
are timed and checked in a process with a CUDA context of its own, on buffers it
makes itself from their shapes and dtypes (timing.Buffers: no CUDA tensor crosses a
process). A candidate that faults ends only this worker; the tuner quarantines it
("runtime_fault") and a fresh worker serves the rest.

    job   {"id", "fn": "module:function" (the runner, default measure), "env",
           "task": {"what": "time" | "verify", "region", "spec", "config", "binary"
                    (spec/config/binary None: the region's torch form), "buffers",
                    "sizes", "device", "seed", "budget" (time only, optional:
                    [warmup ms, rep ms], then the reply's samples too)}}
    reply {"id", "status": "ok", "result": {"ms": float (, "samples": [ms...])}
                                           | {"mismatch": str | None}}
        | {"id", "status": "error", "reason"}   raised, CUDA context intact: the
                                                  candidate cannot run (not a fault)
        | {"id", "status": "fault", "reason", "retire": True}   a CUDA error: this
                                                  worker's context is lost; it exits
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections import OrderedDict

from kiln.codegen.autotune.compile_worker import _apply_env, _reason, resolve, serve

FAULT = "fault"

# What CUDA (and HIP) say when a kernel faulted: the context is unusable after these.
_FAULT_TEXT = re.compile(r"CUDA error|CUDA_ERROR|cudaError|hipError|illegal memory access|"
                         r"illegal instruction|misaligned address|unspecified launch failure|"
                         r"device-side assert|an illegal address|launch failed", re.I)


# binary digest -> the Binary first sent with it, its module loaded: a candidate is timed
# in several jobs (its screen, the rest, each size): a job's first run, which loads the
# module and launcher, took 6.7 s over an 8B LLM's 728 candidate jobs on an H200, 4.1-4.3 s
# with the loaded ones reused
_LOADED: OrderedDict[tuple[str, str], object] = OrderedDict()
_LOADED_MAX = 64


def _loaded(binary):
    """The Binary of this worker that holds the same code as `binary` (it, if new)."""
    code = binary.asm.get(binary.binary_ext)
    if not isinstance(code, bytes | str):
        return binary
    key = (binary.name, hashlib.sha256(code if isinstance(code, bytes)
                                       else code.encode()).hexdigest())
    if key in _LOADED:
        _LOADED.move_to_end(key)
        return _LOADED[key]
    _LOADED[key] = binary
    if len(_LOADED) > _LOADED_MAX:
        _LOADED.popitem(last=False)
    return binary


def _kernel(task: dict):
    from kiln.codegen.build.spec import Config, KernelSpec
    from kiln.codegen.build.triton_kernel import TritonKernel
    from kiln.codegen.torch_kernel import TorchKernel

    if task["spec"] is None:
        return TorchKernel(task["region"], task["device"])
    return TritonKernel(task["region"], KernelSpec.from_json(task["spec"]),
                        Config.from_json(task["config"]), _loaded(task["binary"]))


def measure(task: dict) -> dict:
    """Time a candidate ({"ms"}) or compare its outputs with the torch form's
    ({"mismatch": why, or None when they agree}), on fresh seeded buffers."""
    from kiln.codegen.autotune.timing import make_buffers, median, timed_ms, timed_samples
    from kiln.codegen.autotune.verify import mismatch, outputs
    from kiln.codegen.torch_kernel import TorchKernel

    if task["device"].startswith("cuda:"):  # the compiling process's current device
        import torch

        torch.cuda.set_device(task["device"])
    inputs, outs = make_buffers(task["buffers"], task["device"], task["seed"])
    kernel, sizes = _kernel(task), task["sizes"]
    if task["what"] == "time" and task.get("budget"):  # a screen, or the rest after one
        samples = timed_samples(kernel, inputs, outs, sizes, *task["budget"])
        return {"ms": median(samples), "samples": samples}
    if task["what"] == "time":
        return {"ms": timed_ms(kernel, inputs, outs, sizes)}
    inplace = task["buffers"].inplace
    want = outputs(TorchKernel(task["region"], task["device"], zeroed=True), inputs, outs,
                   sizes, inplace)
    return {"mismatch": mismatch(outputs(kernel, inputs, outs, sizes, inplace), want)}


def fault_of(e: BaseException) -> str | None:
    """Why `e` means the CUDA context is lost (a kernel faulted), or None when it is a
    plain error this process survives."""
    import torch

    if isinstance(e, torch.OutOfMemoryError):
        return None
    if _FAULT_TEXT.search(str(e)) or isinstance(e, getattr(torch, "AcceleratorError", ())):
        return _reason(e)
    if torch.cuda.is_initialized():  # an error that does not say so may still be sticky
        try:
            torch.cuda.synchronize()
        except Exception as after:
            return f"{_reason(e)}; then {_reason(after)}"
    return None


def run_job(job: dict) -> dict:
    import torch

    _apply_env(job["env"])
    try:
        result = resolve(job["fn"])(job["task"])
    except Exception as e:
        why = fault_of(e)
        if why is not None:
            return {"id": job["id"], "status": FAULT, "reason": why, "retire": True}
        reply = {"id": job["id"], "status": "error", "reason": _reason(e)}
    else:
        reply = {"id": job["id"], "status": "ok", "result": result}
    if torch.cuda.is_initialized() and torch.cuda.memory_reserved() > _kept_bytes():
        torch.cuda.empty_cache()  # the jobs' buffers: GPU memory the parent may want
    return reply


def _kept_bytes() -> int:
    """GPU memory the worker keeps cached between jobs. Emptying the cache after every
    job made each next one allocate its buffers and do_bench's 256 MB L2-clearing
    buffer anew (~865 jobs for an 8B LLM; its tuning 22.1 -> 16.2 / 18.6 s on an H200
    once kept). Up to 4 GiB (at most 5% of the GPU) stays; the worker is stopped when
    the compile's kernels are chosen."""
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return min(4 << 30, total // 20)


def _warm_up() -> None:
    import torch
    import triton.testing  # noqa: F401

    import kiln.codegen.build.triton_kernel  # noqa: F401
    import kiln.codegen.torch_kernel  # noqa: F401 - registers kiln's ops

    if torch.cuda.is_available():  # make the context now: its seconds are no job's
        torch.zeros(1, device="cuda")


def main(argv: list[str]) -> None:
    serve(argv, run_job, _warm_up)


if __name__ == "__main__":
    main(sys.argv)
