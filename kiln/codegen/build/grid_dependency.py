"""Programmatic dependent launch: the next kernel is scheduled as the last one drains.

A decode step is hundreds of small kernels, and each boundary costs the launch of the
next kernel after the previous one has completed. On Hopper and later a kernel launched
with programmatic stream serialization is scheduled as its predecessor's blocks exit;
its blocks wait in `griddepcontrol.wait` until the predecessor has finished and its
writes are visible. Measured on an H200 (8-layer Llama-3-8B decode in a CUDA graph):
-0.7 us a boundary, 3.7% off the fp16 step and 6.5% off the fp8 step.

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
torch's kernels (cuBLAS, copies) are launched without the attribute and keep the
ordinary stream order.

KILN_PDL=1 turns it on; it is off by default until `pytest -m gpu` has run whole with
it (the one run so far did not finish within its call and had failures not yet told
apart from older ones: benchmarks/RESULTS.md, 2026-11-28 fifth session).

Overlap beyond the launch needs work a kernel may do before its wait, and a predecessor
that releases it early. Templates mark both in their source with comments an ordinary
build ignores: `#pdl wait` where the wait goes (only index arithmetic before it),
`#pdl prefetch <addresses>` before it (a GEMV asks L2 for the first bytes of the weight
rows it will stream: L2 is where every SM's loads and stores meet, so a prefetch can
never return stale data, whatever the predecessor writes), and `#pdl release` where
its dependents may launch (a GEMV after its K loop, while its split parts combine).
KILN_PDL_PREFETCH sets the prefetch's bytes a row, KILN_PDL_RELEASE which kernels
release (`loop`: at the marks; a template kind: right after the wait).
"""

from __future__ import annotations

import re

from kiln.settings import pdl_enabled, pdl_prefetch_bytes, pdl_release
from kiln.target import Target

_IMPORT = ("from triton.language.extra.cuda import gdc_wait as _kiln_gdc_wait\n"
           "from triton.language.extra.cuda import gdc_launch_dependents as _kiln_gdc_release\n")
_WAIT = "_kiln_gdc_wait()  # the previous kernel has finished (grid_dependency.py)"
_RELEASE = "_kiln_gdc_release()  # the next kernel may launch (grid_dependency.py)"
# one prefetch of a 128-byte line into L2 per address; the result is a dummy
_PREFETCH_HELPER = '''
import triton as _kiln_triton
import triton.language as _kiln_tl


@_kiln_triton.jit
def _kiln_l2_prefetch(ptr):
    _kiln_tl.inline_asm_elementwise("prefetch.global.L2 [$1];\\n\\tmov.u32 $0, 0;", "=r,l",
                                    [ptr], dtype=_kiln_tl.int32, is_pure=False, pack=1)
'''
WAIT_MARK = "#pdl wait"
RELEASE_MARK = "#pdl release"
PREFETCH_MARK = "#pdl prefetch "
LINE_BYTES = 128  # what one prefetch brings into L2
# what a line before the wait must not do: read or write memory, or call a helper
_MEMORY = re.compile(r"tl\.(load|store|atomic_\w+)\(|libdevice|extra\.")


def applies(target: Target) -> bool:
    """Are kernels for `target` launched as programmatic dependents (CUDA sm_90 and later,
    KILN_PDL=1)?"""
    return (target.backend == "cuda" and isinstance(target.arch, int) and target.arch >= 90
            and pdl_enabled())


def key() -> str:
    """What a binary built under the current settings depends on, for cache keys."""
    return f"pdl:{prefetch_bytes()}:{','.join(sorted(pdl_release()))}"


def prefetch_bytes() -> int:
    """Bytes of each weight row a GEMV prefetches before its wait (whole lines)."""
    return max(0, pdl_prefetch_bytes()) // LINE_BYTES * LINE_BYTES


def prefetch_lines(dtype_bytes: int) -> tuple[int, int]:
    """(lines a row, elements a line) of a GEMV's prefetch of `dtype_bytes`-wide weights;
    (0, 0) when none is asked for."""
    lines = prefetch_bytes() // LINE_BYTES
    if not lines:
        return 0, 0
    return 1 << (lines.bit_length() - 1), LINE_BYTES // dtype_bytes


def with_grid_dependency(source: str, name: str, kind: str = "") -> str | None:
    """`source` with kernel `name`'s body waiting for its predecessor: at its `#pdl
    wait` mark (after its `#pdl prefetch` lines) when only arithmetic precedes the mark,
    else before its first line; releasing its dependents at `#pdl release` marks or
    right after the wait, as KILN_PDL_RELEASE says for `kind`. None where `name`'s
    signature is not on one `def` line (the kernel is then launched the ordinary way)."""
    lines = source.splitlines(keepends=True)
    head = re.compile(rf"^def {re.escape(name)}\(.*\):\s*(#.*)?$")
    start = next((i + 1 for i, line in enumerate(lines) if head.match(line.rstrip("\n"))),
                 None)
    if start is None:
        return None
    release = pdl_release()
    helpers = set(re.findall(r"^def (\w+)\(", source, re.M)) - {name}
    mark = next((i for i in range(start, len(lines)) if lines[i].strip() == WAIT_MARK), None)
    if mark is not None and not _only_arithmetic(lines[start:mark], helpers):
        mark = None
    body, prefetched = [], False
    for i in range(start, len(lines)):
        line, text = lines[i], lines[i].strip()
        pad = line[:len(line) - len(line.lstrip())]
        if text == WAIT_MARK:
            if mark is not None:
                body.append(pad + _WAIT + "\n")
                if kind in release:
                    body.append(pad + _RELEASE + "\n")
        elif text.startswith(PREFETCH_MARK):
            if mark is not None and i < mark and prefetch_bytes():
                body.append(f"{pad}_kiln_l2_prefetch({text[len(PREFETCH_MARK):]})\n")
                prefetched = True
        elif text == RELEASE_MARK:
            if "loop" in release:
                body.append(pad + _RELEASE + "\n")
        else:
            body.append(line)
    if mark is None:
        pad = next((ln[:len(ln) - len(ln.lstrip())] for ln in lines[start:] if ln.strip()),
                   "    ")
        opening = [pad + _WAIT + "\n"] + ([pad + _RELEASE + "\n"] if kind in release else [])
        body = opening + body
    helper = _PREFETCH_HELPER if prefetched else ""
    return _IMPORT + helper + "".join(lines[:start]) + "".join(body)


def _only_arithmetic(lines: list[str], helpers: set[str]) -> bool:
    """Whether `lines` (a kernel body's opening) touch no memory and call no helper,
    so they may run before the predecessor has finished."""
    for line in lines:
        code = line.split("#", 1)[0]
        if _MEMORY.search(code) or any(re.search(rf"\b{h}\(", code) for h in helpers):
            return False
    return True
