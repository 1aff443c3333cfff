"""Programmatic dependent launch: the next kernel is scheduled as the last one drains.

A decode step is hundreds of small kernels, and each boundary costs the launch of the
next kernel after the previous one has completed. On Hopper and later a kernel launched
with programmatic stream serialization is scheduled as its predecessor's blocks exit;
its blocks wait in `griddepcontrol.wait` until the predecessor has finished and its
writes are visible. Measured on an H200 (8-layer Llama-3-8B decode in a CUDA graph):
-0.7 us a boundary, 3.7% off the fp16 step and 6.5% off the fp8 step; at 32 layers
(kiln bench) 4.2-4.4% off fp16 and 2.2-4.5% off fp8.

Every kiln kernel for such a target opens with that wait, before any load or store: it
never reads what its predecessor has not finished writing nor overwrites what it still
reads, and since every kiln kernel waits, a kernel's end implies every earlier kernel's
end. It is launched as a dependent only where a Program knows the work just before it
in the stream is another kiln kernel (runtime/program.py `follows_kernel`): the first
kernel of a call (after the caller's copies), one after a torch region, and one whose
launch zeroes or copies a tensor first launch the ordinary way, whatever CUDA makes of
a copy or memset followed by a dependent launch. Kernels do not release their
dependents early (`griddepcontrol.launch_dependents` at the top): blocks of the next
kernel then sat on SMs the running GEMVs needed and made the fp16 step 13% slower.
Giving the early blocks work to do before their wait (each GEMV asking L2 for its
first weight bytes, released after its predecessor's K loop) was slower too: 764 ->
785 us for 4 fp16 layers (benchmarks/NOTES.md), and so was its register form (each GEMV
reading its first weight tile before its wait, releasing after its K loop): 1205 ->
1221-1227 us for 8 layers, where a probe's chains of GEMVs alone had gained 0.3-1 us a
GEMV (2026-12-01).
torch's kernels (cuBLAS, copies) are launched without the attribute and keep the
ordinary stream order.

On by default; KILN_PDL=0 turns it off. The whole `pytest -m gpu` suite ran with it on
an H200 (2026-11-28, seventh session) with the same three failures as without it, all
three since fixed in the tests and the tuner (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import re

from kiln.settings import pdl_enabled
from kiln.target import Target

_IMPORT = "from triton.language.extra.cuda import gdc_wait as _kiln_gdc_wait\n"
_PROLOGUE = "    _kiln_gdc_wait()  # the previous kernel has finished (grid_dependency.py)\n"


def applies(target: Target) -> bool:
    """Are kernels for `target` launched as programmatic dependents (CUDA sm_90 and later,
    unless KILN_PDL=0)?"""
    return (target.backend == "cuda" and isinstance(target.arch, int) and target.arch >= 90
            and pdl_enabled())


def with_grid_dependency(source: str, name: str) -> str | None:
    """`source` with kernel `name`'s body opened by the grid-dependency wait;
    None where `name`'s signature is not on one `def` line (the kernel is then launched
    the ordinary way)."""
    lines = source.splitlines(keepends=True)
    head = re.compile(rf"^def {re.escape(name)}\(.*\):\s*(#.*)?$")
    for i, line in enumerate(lines):
        if head.match(line.rstrip("\n")):
            body = lines[:i + 1] + [_PROLOGUE] + lines[i + 1:]
            return _IMPORT + "".join(body)
    return None
