"""`kiln compile MODEL`: compile and save an artifact (or print a stage's IR)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kiln.cli.model_spec import compile_model, is_artifact
from kiln.errors import KilnError


def cmd_compile(args) -> int:
    from kiln import CompiledModule
    from kiln.ir.printer import print_ir

    if is_artifact(args.model):
        raise KilnError(f"{args.model} is an artifact, already compiled",
                        hint=f"run it with `kiln run {args.model}` or inspect it with "
                        f"`kiln explain {args.model}`")
    exe, secs = compile_model(args, compile_to=args.compile_to, dump_ir=args.dump_ir)
    if not isinstance(exe, CompiledModule):
        print(print_ir(exe), end="")
        print(f"# stopped after stage {args.compile_to} ({secs:.2f} s)", file=sys.stderr)
        return 0
    out = args.output or f"{Path(args.model.split(':')[0]).stem}.kiln"
    t0 = time.perf_counter()
    exe.save(out)
    kinds = {}
    for k in exe.program.kplan.kernels.values():
        kinds[k.kind] = kinds.get(k.kind, 0) + 1
    print(f"compiled {args.model} for {exe.target} in {secs:.2f} s: {len(exe.plan.regions)} "
          f"regions ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))} kernels)")
    print(f"saved {out} in {time.perf_counter() - t0:.2f} s")
    return 0
