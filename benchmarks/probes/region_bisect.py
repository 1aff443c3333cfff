"""Which region makes a model wrong on a target: its regions forced to torch ops by kind
(each kind alone as torch ops, then each kind alone generated), then one region at a
time generated with every other as torch ops. Prints one line a compile, then the bad
regions' IR; `--out F` writes the same text to F (a device call's output is cut).

Why: benchmarks/zoo_gpu.py found a model wrong on a GPU only (Doge, bf16, H200, 2026-11-30:
rel err 0.65, right on the cpu and interpret targets); a fallback of one region at a time
names the kernel without a debugger.

    PYTHONPATH=. python benchmarks/probes/region_bisect.py Doge [--set forward|models|llms]
        [--dtype bfloat16] [--target cuda] [--budget-s 200] [--out $OUT/bisect.txt]

The model is zoo_gpu.py's row of that name in that set (tiny, random). First it checks
that the bug is a region's at all: torch.export's own module against eager, and every
region as torch ops (Doge's was neither: transformers 5.17 runs it without its causal
mask in eager only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

import kiln
import kiln.codegen.select_kernels as select
from kiln.errors import KilnWarning

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import zoo_gpu  # noqa: E402  (benchmarks/ is not a package)


class Bisect:
    """Compiles of one zoo_gpu row with a chosen set of regions run as torch ops."""

    def __init__(self, set_name: str, name: str, dtype, target: str):
        self.device = "cpu" if target in ("cpu", "interpret") else "cuda"
        self.case = zoo_gpu.CASES[set_name](name, dtype, self.device)
        self.target = target
        self.ref = self.case.call(self.case.model)
        self.as_torch = lambda region: False
        self.regions: dict[str, str] = {}  # name -> kind, in plan order
        template_for = select.template_for

        def chosen(region):
            self.regions.setdefault(region.name, region.kind.value)
            return None if self.as_torch(region) else template_for(region)

        select.template_for = chosen

    def export_error(self) -> float:
        """torch.export's own module against eager: kiln compiles what export traced."""
        with torch.no_grad():
            traced = torch.export.export(self.case.model, *self.case.example).module()
        return zoo_gpu.rel(self.case.call(traced), self.ref)

    def error(self, as_torch) -> tuple[float, object]:
        self.as_torch = as_torch
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KilnWarning)
            exe = kiln.compile(self.case.model, *self.case.example, target=self.target,
                               options={"compile_cache": False})
        return zoo_gpu.rel(self.case.call(exe), self.ref), exe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("name")
    p.add_argument("--set", default="forward", choices=sorted(zoo_gpu.CASES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--target", default="cuda")
    p.add_argument("--tol", type=float, default=1e-2)
    p.add_argument("--budget-s", type=float, default=200.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    t0 = time.perf_counter()
    b = Bisect(args.set, args.name, getattr(torch, args.dtype), args.target)
    err, exe = b.error(lambda r: False)
    text = exe.describe()
    say(f"{args.name} {args.dtype} on {args.target}: every region generated {err:.2e}; "
        f"{len(b.regions)} regions, {text.count('# extern')} of them extern")
    traced = b.export_error()
    say(f"torch.export's own module against eager: {traced:.2e}")
    everything, _ = b.error(lambda r: True)
    say(f"every region as torch ops: {everything:.2e}")
    if everything > args.tol:
        say("wrong with no kernel of kiln's: the graph, not a region"
            + (" (torch.export already differs from eager)" if traced > args.tol else ""))
    else:
        bisect(b, args, say, t0, text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


def bisect(b: Bisect, args, say, t0: float, text: str) -> None:
    for kind in sorted(set(b.regions.values())):
        apart, _ = b.error(lambda r, k=kind: r.kind.value == k)
        alone, _ = b.error(lambda r, k=kind: r.kind.value != k)
        say(f"kind {kind}: as torch ops {apart:.2e}; alone generated {alone:.2e}")
    bad = []
    for name, kind in list(b.regions.items()):
        if time.perf_counter() - t0 > args.budget_s:
            say("budget spent")
            break
        e, _ = b.error(lambda r, n=name: r.name != n)
        say(f"only {name} ({kind}) generated: {e:.2e}{'  <- wrong' if e > args.tol else ''}")
        if e > args.tol:
            bad.append(name)
    for name in bad:
        start = text.find(f"  region {name} ")
        end = text.find("  region ", start + 1)
        say(text[start:end if end > 0 else None])


if __name__ == "__main__":
    main()
