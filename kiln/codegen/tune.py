"""Pick a config for a generated kernel: the simplest policy until the autotuner lands.

Compiles the heuristic config in-process (or, on the interpret target, runs it as is)
and checks its real resources against the target; a failure falls back to the extern
form with a note on the region. The isolated, caching autotuner replaces this.
"""

from __future__ import annotations

import logging

from kiln.codegen.torch_kernel import TorchKernel
from kiln.codegen.triton.compiler import compile_binary
from kiln.codegen.triton.kernel import TritonKernel
from kiln.codegen.triton.spec import KernelSpec
from kiln.ir.plan import Region
from kiln.target import Target

log = logging.getLogger("kiln.codegen")


def fits(res, target: Target) -> bool:
    return res.shared <= target.shared_mem_per_block and (
        res.registers is None or res.registers <= target.registers_per_thread)


def choose(region: Region, spec: KernelSpec, target: Target, ctx):
    config = spec.default
    if target.backend == "interpret":
        return TritonKernel(region, spec, config, interpret=True)
    try:
        binary = compile_binary(spec, config, target)
    except Exception as e:  # a compiler error costs this kernel, not the compile
        region.notes.append(f"extern: Triton failed to compile [{config}]: {e}")
        return TorchKernel(region, target.torch_device)
    if not fits(binary.resources, target):
        region.notes.append(f"extern: [{config}] needs {binary.resources.shared} B shared")
        return TorchKernel(region, target.torch_device)
    return TritonKernel(region, spec, config, binary)
