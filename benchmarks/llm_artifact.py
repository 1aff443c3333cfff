"""How long a user waits for an LLM: a cold compile, a second compile of the same model
(tuning results from KILN_CACHE_DIR), and loading the LLM saved by the first.

Each step runs in a fresh process sharing one new KILN_CACHE_DIR, as separate
`kiln generate` invocations would; each reports kiln.models.load's time, the whole
process's wall time (imports included) and the greedy tokens of one prompt, which
must be the same in all three. Compiling for a GPU this machine lacks (compile-only)
measures the two compiles alone.

    python benchmarks/llm_artifact.py --model tiny --target cpu --out llm_artifact_cpu.json
    python benchmarks/llm_artifact.py --model /path/to/Llama-3.1-8B --target cuda \
        --max-seq-len 2048 --out llm_artifact_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = [1, 15043, 29892, 590, 1024, 338]  # token ids: no tokenizer needed
ROOT = Path(__file__).resolve().parent.parent


def _cache_entries(cache: Path) -> int:
    choices = cache / "autotune" / "choices"
    return len(list(choices.iterdir())) if choices.is_dir() else 0


def step(args) -> dict:
    """One step, in this process: load (compiling, or from the saved LLM), maybe save."""
    import kiln.models

    t0 = time.perf_counter()
    kw = {} if args.step == "load" else dict(
        dtype=args.dtype, target=args.target, max_seq_len=args.max_seq_len,
        max_batch_size=args.max_batch_size)
    llm = kiln.models.load(args.saved if args.step == "load" else args.model, **kw)
    out = {"load_s": time.perf_counter() - t0, "target": llm.target.name, "tokens": None}
    if llm.runnable:  # not when compiling for a GPU this machine lacks
        prompt = [i % llm.cfg.vocab_size for i in PROMPT]
        out["tokens"] = llm.generate(prompt, max_new_tokens=args.new_tokens,
                                     ignore_eos=True).ids
    if args.step == "compile-and-save":
        t0 = time.perf_counter()
        llm.save(args.saved)
        out["save_s"] = time.perf_counter() - t0
        out["saved_bytes"] = sum(f.stat().st_size for f in Path(args.saved).rglob("*")
                                 if f.is_file())
    return out


def run_step(name: str, args, cache: Path) -> dict:
    env = dict(os.environ, KILN_CACHE_DIR=str(cache), KILN_PROGRESS="0",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, __file__, "--step", name, "--model", args.model, "--target",
           args.target, "--saved", args.saved, "--new-tokens", str(args.new_tokens),
           "--max-batch-size", str(args.max_batch_size)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.max_seq_len:
        cmd += ["--max-seq-len", str(args.max_seq_len)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"step {name} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(process_wall_s=wall, cache_entries_after=_cache_entries(cache))
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny", help="a checkpoint directory or a preset")
    p.add_argument("--target", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--out", help="JSON results (required unless --step)")
    p.add_argument("--step", choices=["compile-and-save", "compile", "load"],
                   help=argparse.SUPPRESS)
    p.add_argument("--saved", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.step:
        print(json.dumps(step(args)))
        return
    if not args.out:
        p.error("--out is required")
    with tempfile.TemporaryDirectory(prefix="kiln-llm-artifact-") as tmp:
        cache, args.saved = Path(tmp) / "cache", str(Path(tmp) / "llm.kiln")
        results = {name: run_step(name, args, cache) for name in ("compile-and-save", "compile")}
        if results["compile"]["tokens"] is not None:  # a saved LLM this machine can run
            results["load"] = run_step("load", args, cache)
    tokens = {name: r.pop("tokens") for name, r in results.items()}
    names = {"compile-and-save": "first compile", "compile": "second compile",
             "load": "load saved"}
    report = {"model": args.model, "target": results["compile"]["target"],
              "same_tokens": len({tuple(t or ()) for t in tokens.values()}) == 1,
              "tokens": tokens["compile"],
              "steps": {names[n]: r for n, r in results.items()}}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for name, r in report["steps"].items():
        extra = f", saved {r['saved_bytes'] / 2**20:.1f} MiB in {r['save_s']:.2f} s" \
            if "save_s" in r else ""
        print(f"{name:>15}: kiln.models.load {r['load_s']:7.2f} s, process "
              f"{r['process_wall_s']:7.2f} s, {r['cache_entries_after']} cached tuning "
              f"choices{extra}")
    if tokens["compile"] is None:
        print("compile-only (no GPU of the target here): nothing generated or loaded")
    else:
        print(f"same greedy tokens in every step: {report['same_tokens']}")


if __name__ == "__main__":
    main()
