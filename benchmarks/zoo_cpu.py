"""The zoo (tests/zoo) and `kiln run tiny-llama`'s prefill and decode timed: kiln's compile
time and per-call time beside eager, on the CPU target (or --target cuda on a GPU), one
line per model.

    PYTHONPATH=. python benchmarks/zoo_cpu.py [--target cuda] [--rounds 15] [--threads 1]
        [--clock thread] [--only lstm,gru] [--out F.json]

kiln and eager are timed in alternating rounds (a round: `--iters` calls of one, then
of the other), so a load that comes and goes on a shared machine hits both alike; the
per-call times are the medians over rounds, kiln/eager the median of the rounds'
ratios, and "spread" the quartiles of those ratios (how noisy the machine was).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings

import torch

import kiln
from kiln.errors import KilnWarning
from kiln.ir.ops import is_fallback
from tests.zoo.test_zoo import CASES, HF_LMS, _first, _hf, _rel

CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
_clock = time.perf_counter


def _round_ms(fn, args, kwargs, device: str, iters: int) -> float:
    """Mean milliseconds per call over `iters` back-to-back calls."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = _clock()
    for _ in range(iters):
        fn(*args, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    return (_clock() - t0) * 1e3 / iters


def _alternating(kiln_fn, eager_fn, args, kwargs, device, rounds, iters):
    """(kiln ms, eager ms, median ratio, ratio quartiles) over alternating rounds."""
    for fn in (kiln_fn, eager_fn):  # warm up
        _round_ms(fn, args, kwargs, device, 3)
    ks, es = [], []
    for _ in range(rounds):
        ks.append(_round_ms(kiln_fn, args, kwargs, device, iters))
        es.append(_round_ms(eager_fn, args, kwargs, device, iters))
    ratios = sorted(k / e for k, e in zip(ks, es))
    quart = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return statistics.median(ks), statistics.median(es), quart[1], (quart[0], quart[2])


def _row(name, compile_s, kiln_fn, eager_fn, a, kwargs, device, args, fallen=()) -> dict:
    """Time one model both ways, print its line, return it as a JSON row."""
    with torch.no_grad():
        k, e, ratio, (lo, hi) = _alternating(kiln_fn, eager_fn, a, kwargs, device,
                                             args.rounds, args.iters)
        err = _rel(_first(kiln_fn(*a, **kwargs)), _first(eager_fn(*a, **kwargs)))
    print(f"{name:22}{compile_s:10.2f}{k:10.3f}{e:10.3f}{ratio:11.2f}"
          f"{f'{lo:.2f}-{hi:.2f}':>12}{err:10.1e}  {', '.join(fallen) or '-'}", flush=True)
    return {"model": name, "compile_s": compile_s, "kiln_ms": k, "eager_ms": e,
            "kiln_over_eager": ratio, "ratio_quartiles": [lo, hi], "rel_err": err,
            "fallbacks": list(fallen)}


def _tiny_llama_rows(device: str, args) -> list[dict]:
    """`kiln run tiny-llama`'s model as kiln.models.LLM runs it: a 16-token prefill and a
    decode step (the same position each call: it rewrites one cache slot), against the
    eager model on the same calls. Compile time covers both modules."""
    from kiln.cli.model_spec import load_model_spec
    from kiln.models.generate import LLM

    spec = load_model_spec("tiny-llama")
    eager = copy.deepcopy(spec.model).to(device)
    t0 = time.perf_counter()
    llm = LLM(spec.model.to(device), target=args.target)
    compile_s = time.perf_counter() - t0
    prompt = torch.randint(0, llm.cfg.vocab_size, (1, 16), device=device)
    pos = torch.arange(16, device=device)
    step = (torch.tensor([[5]], device=device), torch.tensor([16], device=device))
    with torch.no_grad():
        llm.forward(prompt, pos)
        eager(prompt, pos)
    only = args.only.split(",") if args.only else None
    return [_row(name, compile_s, llm.forward, eager, a, {}, device, args)
            for name, a in (("tiny_llama_prefill16", (prompt, pos)),
                            ("tiny_llama_decode", step))
            if only is None or name in only]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="cpu")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=20, help="calls per round")
    p.add_argument("--only", default="", help="comma-separated model names")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--threads", type=int, default=0,
                   help="torch's intra-op threads (0: torch's default)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="thread: this thread's CPU time, which other processes on a "
                   "shared machine disturb less (use with --threads 1 on the CPU)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    global _clock
    _clock = CLOCKS[args.clock]
    device = "cuda" if args.target.startswith("cuda") else "cpu"
    cases = dict(CASES)
    for name, make in HF_LMS.items():
        cases[name] = (lambda make=make: (_hf(*make()), lambda: (
            torch.randint(0, 100, (2, 9)),)))
    if args.only:
        cases = {n: cases[n] for n in args.only.split(",") if n in cases}
    print(f"{'model':22}{'compile s':>10}{'kiln ms':>10}{'eager ms':>10}{'kiln/eager':>11}"
          f"{'spread':>12}{'rel err':>10}  fallbacks", flush=True)
    rows = []
    for name, make in cases.items():
        model, make_args = make()
        model = model.eval().to(device)
        kwargs = {"use_cache": False} if name in HF_LMS else {}
        a = tuple(t.to(device) for t in make_args())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KilnWarning)  # listed in the last column
            t0 = time.perf_counter()
            exe = kiln.compile(model, a, kwargs, target=args.target)
            compile_s = time.perf_counter() - t0
        fallen = sorted({op.target.split(".")[1] for r in exe.plan.regions for op in r.ops
                         if is_fallback(op.target)})
        rows.append(_row(name, compile_s, exe, model, a, kwargs, device, args, fallen))
    if not args.only or any(n.startswith("tiny_llama") for n in args.only.split(",")):
        rows += _tiny_llama_rows(device, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"target": args.target, "threads": torch.get_num_threads(),
                       "clock": args.clock,
                       "rounds": args.rounds, "iters": args.iters, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
