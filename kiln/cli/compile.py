"""`kiln compile MODEL`: compile and save an artifact (or print a stage's IR).
`kiln compile --model DIR`: compile an LLM for generation and save it (LLM.save)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kiln.cli.model_spec import compile_model, is_artifact
from kiln.errors import KilnError


def cmd_compile(args) -> int:
    from kiln import CompiledModule
    from kiln.ir.printer import print_ir

    if args.checkpoint is not None:
        return _compile_llm(args)
    if args.model is None:
        raise KilnError("name what to compile: MODEL (path/to/file.py:factory or a built-in), "
                        "or --model DIR for an LLM checkpoint")
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
          f"regions ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))} kernels)"
          + _narrow_note(exe))
    print(f"saved {out} in {time.perf_counter() - t0:.2f} s")
    return 0


def _compile_llm(args) -> int:
    """Compile the LLM at --model (a checkpoint or a preset) and save it with LLM.save."""
    from kiln.models import load
    from kiln.models.saved_llm import is_saved_llm

    source = args.checkpoint
    if args.model is not None:
        raise KilnError(f"name one thing to compile: MODEL {args.model} or --model {source}")
    strict = args.fallback if args.fallback != "allow" else None
    for flag, value in (("--compile-to", args.compile_to), ("--dump-ir", args.dump_ir),
                        ("--tune", args.tune), ("--fallback", strict)):
        if value is not None:
            raise KilnError(f"{flag} is for MODEL, not for an LLM (--model)")
    if is_saved_llm(source):
        raise KilnError(f"{source} is a compiled LLM already",
                        hint=f"generate from it: kiln generate {source} --prompt TEXT")
    out = Path(args.output or f"{Path(source).name}.kiln")
    t0 = time.perf_counter()
    llm = load(source, dtype=args.dtype, target=args.target, max_seq_len=args.max_seq_len,
               max_batch_size=args.max_batch_size, paged=args.cache == "paged",
               block_size=args.block_size, random_weights=args.random_weights,
               quantize=args.quantize)
    print(f"compiled {source} for {llm.target} in {time.perf_counter() - t0:.2f} s: prefill "
          f"{len(llm.prefill_module.plan.regions)} regions, decode "
          f"{len(llm.decode_module.plan.regions)}" + _narrow_note(llm.decode_module))
    t0 = time.perf_counter()
    llm.save(out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"saved {out} ({size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.2f} s; "
          f"generate with: kiln generate {out} --prompt TEXT")
    return 0


def _narrow_note(exe) -> str:
    """The narrow version a module carries (kiln/runtime/program.py), in a few words."""
    n = exe.program.narrow
    if n is None:
        return ""
    dim = exe.plan.dim_names.get(n.symbol, n.symbol)
    return f"; {dim} <= {n.hi} runs a plan of its own ({len(n.program.plan.regions)} regions)"
