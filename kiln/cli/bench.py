"""`kiln bench`: kiln, eager PyTorch and torch.compile on one model in one run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kiln.bench import report, sweep
from kiln.bench.runners import RUNNERS
from kiln.errors import ArgumentError
from kiln.settings import effective

# What each preset measures unless told otherwise: the table for the 8B, and
# sizes a CPU runs in seconds for the tiny one (CI's smoke test).
DEFAULTS = {
    "llama3-8b": {"prefill": (128, 2048), "contexts": (128, 2048), "batches": (1, 4),
                  "sweep": (1, 4, 16, 64)},
    "tiny": {"prefill": (16, 64), "contexts": (16, 64), "batches": (1, 2), "sweep": ()},
}


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ArgumentError(f"{flag} takes comma-separated integers, got {text!r}",
                            hint=f"e.g. {flag} 128,2048") from None
    if any(v < 1 for v in values):
        raise ArgumentError(f"{flag} values must be at least 1, got {text!r}")
    return values


def _lengths(text: str | None, flag: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """The preset's lengths when the flag is not given; none for '' (skip those rows)."""
    return default if text is None else _ints(text, flag)


def _plan(args) -> sweep.Plan:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ArgumentError("--device cuda, but this machine has no CUDA GPU",
                            hint="run `kiln bench --device cpu --preset tiny` here")
    runners = tuple(r.strip() for r in args.runners.split(","))
    unknown = [r for r in runners if r not in RUNNERS]
    if unknown:
        raise ArgumentError(f"unknown runner(s) {', '.join(unknown)}",
                            hint=f"--runners takes a list of {', '.join(RUNNERS)}")
    for flag, value in (("--iters", args.iters), ("--layers", args.layers)):
        if value is not None and value < 1:
            raise ArgumentError(f"{flag} must be at least 1, got {value}")
    d = DEFAULTS[args.preset]
    dtype = args.dtype or ("float16" if args.device == "cuda" else "float32")
    plan = sweep.Plan(
        device=args.device, preset=args.preset, dtype=getattr(torch, dtype),
        layers=args.layers, runners=runners, iters=args.iters, quantize=args.quantize,
        prefill=_lengths(args.prefill, "--prefill", d["prefill"]),
        contexts=_lengths(args.contexts, "--contexts", d["contexts"]),
        batches=_ints(args.batches, "--batches") or d["batches"],
        sweep=_ints(args.sweep, "--sweep") if args.sweep is not None else d["sweep"])
    if not plan.prefill and not plan.contexts:
        raise ArgumentError("--prefill '' and --contexts '' leave nothing to measure",
                            hint="give prompt lengths, decode contexts, or both")
    if plan.quantize and "kiln" not in plan.runners:
        raise ArgumentError(f"--quantize {plan.quantize} times kiln only, but --runners "
                            f"{args.runners} leaves kiln out",
                            hint="add kiln to --runners (eager then gives the fp8 rows' "
                            "reference)")
    if plan.sweep and not plan.contexts:
        raise ArgumentError("--sweep measures decode, but --contexts '' gives no context",
                            hint="add --sweep '' for a prefill-only run")
    limit = plan.shape().max_len
    too_long = [n for n in (*plan.prefill, *plan.contexts) if n >= limit]
    if too_long:
        raise ArgumentError(f"lengths {too_long} do not fit preset {args.preset}'s cache "
                            f"of {limit} positions",
                            hint=f"give --prefill / --contexts below {limit}")
    return plan


def cmd_bench(args) -> int:
    baseline = _read_baseline(args.check) if args.check else None
    plan = _plan(args)
    _check_out(Path(args.out))
    data = report.to_json(sweep.run(plan), effective())
    print(report.table(data))
    out = Path(args.out)
    for note in report.save(data, out):
        print(note, file=sys.stderr)
    written = [str(out / n) for n in ("bench.json", "bench.txt", "bench.png")
               if (out / n).exists()]
    print(f"wrote {', '.join(written)}", file=sys.stderr)
    if baseline is None:
        return 0
    compared = {r["key"] for r in baseline.get("rows", [])} & {r["key"] for r in data["rows"]}
    if not compared:
        print(f"kiln: error: {args.check} shares no rows with this run: nothing to check",
              file=sys.stderr)
        return 2
    if baseline.get("device") != data["device"]:
        print(f"warning: the baseline ran on {baseline.get('device')}, this run on "
              f"{data['device']}", file=sys.stderr)
    differ = {k: (v, data["settings"].get(k)) for k, v in baseline.get("settings", {}).items()
              if data["settings"].get(k) != v}
    if differ:
        print("warning: settings differ from the baseline's: " + ", ".join(
            f"{k} {was} there, {now} here" for k, (was, now) in differ.items()),
            file=sys.stderr)
    slower = report.check(data, baseline, args.tolerance)
    for line in slower:
        print(f"slower: {line}", file=sys.stderr)
    new = report.unchecked(data, baseline)
    if new:
        print(f"not in the baseline (not checked): {', '.join(new)}", file=sys.stderr)
    print(f"check against {args.check}: {len(compared)} rows, {len(slower)} slower",
          file=sys.stderr)
    return 1 if slower else 0


def _check_out(out: Path) -> None:
    """The output directory can be made, checked before minutes of measuring."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) \
            else e.strerror or e
        raise ArgumentError(f"--out {out}: cannot make the directory: {why}",
                            hint="name a directory (it is created if missing)") from None


def _read_baseline(path: str) -> dict:
    """The stored run to check against, read before measuring so a typo costs nothing."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ArgumentError(f"baseline {path} does not exist",
                            hint="write one with `kiln bench --out DIR` (DIR/bench.json)") \
            from None
    except (OSError, ValueError) as e:
        raise ArgumentError(f"baseline {path} is not a kiln bench JSON file: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ArgumentError(f"baseline {path} has no \"rows\" list",
                            hint="use a bench.json written by `kiln bench`")
    return data
