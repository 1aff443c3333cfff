"""Compile-only (no GPU): the gated delta kernel's sm_90 SASS, per role, and its hottest
loop's instruction mix (issue 14).

Why: the walker's chunk step is latency-bound, and its length in instructions is the
one figure of it that needs no GPU. The twenty-second session cut the loop from 1573 to
1070 instructions (BV 64) by reading this mix (a third was k's fp32 round trip and
selects after masked loads) and measured the walk 10.0 -> 8.3 us a chunk on an H200.

Usage: PYTHONPATH=. python benchmarks/probes/gated_delta_sass.py --shape seed \\
           --configs 64:64:4:2:1,64:32:4:2:1 --roles walkers,whole [--dump k.sass]
(CHUNK:BV:warps:stages:STAGED; Triton's bundled cuobjdump disassembles the cubin)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gated_delta_resources import SHAPES, only, spec_at  # noqa: E402

from kiln.codegen.build.compiler import compile_binary  # noqa: E402
from kiln.codegen.build.spec import Config  # noqa: E402
from kiln.target import get_target  # noqa: E402

_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRANCH = re.compile(r"BRA\s+0x([0-9a-f]+)")


def sass(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS instruction, predicates dropped."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    return [(int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2)))
            for m in map(_LINE.match, text.splitlines()) if m]


def hottest_loop(code: list[tuple[int, str]]) -> list[str]:
    """The instructions of the longest backward branch's body (a chunk loop)."""
    loops = [(int(m.group(1), 16), a) for a, op in code
             if (m := _BRANCH.search(op)) and int(m.group(1), 16) < a]
    if not loops:
        return []
    lo, hi = max(loops, key=lambda x: x[1] - x[0])
    return [op for a, op in code if lo <= a <= hi]


def mix(ops: list[str], top: int = 16) -> str:
    counts = collections.Counter(op.split()[0].split(".")[0] for op in ops)
    return ", ".join(f"{k} {n}" for k, n in counts.most_common(top))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="seed", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--configs", default="64:64:4:2:1")
    ap.add_argument("--roles", default="walkers,whole")
    ap.add_argument("--dump", help="write the last compiled kernel's SASS here")
    a = ap.parse_args()
    target = get_target("cuda:sm_90")
    spec = spec_at(**SHAPES[a.shape], dtype=getattr(torch, a.dtype))
    for text in a.configs.split(","):
        chunk, bv, warps, stages, form = (int(x) for x in text.split(":"))
        config = Config.make(warps, stages, CHUNK=chunk, BV=bv, STAGED=form)
        for role in a.roles.split(","):
            source = spec.source if role == "whole" else only(spec.source, role)
            binary = compile_binary(dataclasses.replace(spec, source=source), config, target)
            code = sass(binary.asm["cubin"])
            loop = hottest_loop(code)
            r = binary.resources
            print(f"{config} {role}: {len(code)} instructions, {r.registers} registers, "
                  f"{r.spills} spilled, {r.shared} B shared; hottest loop {len(loop)}: "
                  f"{mix(loop)}", flush=True)
            if a.dump:
                Path(a.dump).write_text("\n".join(f"{x:05x} {op}" for x, op in code) + "\n")


if __name__ == "__main__":
    main()
