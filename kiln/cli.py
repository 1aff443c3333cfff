"""The `kiln` command: compile, run, explain (like iree-compile / iree-run-module).

A model is named as `path/to/file.py:factory` (a function returning (model, args) or
(model, args, dynamic_shapes)), as a built-in (`tiny-llama`), or, for run and explain,
as a saved artifact directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path

import torch

from kiln.errors import KilnError

EPILOG = "models: path/to/file.py:factory, or a built-in: tiny-llama"


# ---- naming a model ---------------------------------------------------------------


def load_model_spec(spec: str):
    """(model, args, dynamic_shapes) from 'file.py:factory' or a built-in name."""
    from kiln.models import BUILTINS

    if spec in BUILTINS:
        return BUILTINS[spec]()
    path, _, factory = spec.partition(":")
    if not factory or not path.endswith(".py"):
        raise KilnError(
            f"cannot read the model name {spec!r}",
            hint=f"name a model as path/to/file.py:factory or a built-in ({', '.join(BUILTINS)})",
        )
    if not Path(path).is_file():
        raise KilnError(f"model file {path} does not exist")
    mod_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(mod_spec)
    sys.path.insert(0, str(Path(path).resolve().parent))
    try:
        mod_spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    fn = getattr(module, factory, None)
    if fn is None:
        raise KilnError(f"{path} has no function {factory!r}")
    out = fn()
    if isinstance(out, dict):
        return out["model"], tuple(out["args"]), out.get("dynamic_shapes")
    if not isinstance(out, tuple) or len(out) not in (2, 3):
        raise KilnError(
            f"{spec} returned {type(out).__name__}",
            hint="the factory must return (model, args) or (model, args, dynamic_shapes)",
        )
    model, args = out[0], out[1]
    return model, tuple(args) if isinstance(args, (list, tuple)) else (args,), (
        out[2] if len(out) == 3 else None
    )


def _compile(args):
    import kiln

    model, ex_args, dynamic = load_model_spec(args.model)
    t0 = time.perf_counter()
    exe = kiln.compile(model, ex_args, dynamic_shapes=dynamic, target=args.target,
                       compile_to=getattr(args, "compile_to", None),
                       dump_ir=getattr(args, "dump_ir", None))
    return model, ex_args, exe, time.perf_counter() - t0


# ---- subcommands -------------------------------------------------------------------


def cmd_compile(args) -> int:
    from kiln.api import CompiledModule
    from kiln.ir.printer import print_ir

    _, _, exe, secs = _compile(args)
    if not isinstance(exe, CompiledModule):
        print(print_ir(exe), end="")
        print(f"# stopped after stage {args.compile_to} ({secs:.2f} s)", file=sys.stderr)
        return 0
    out = args.output or f"{Path(args.model.split(':')[0]).stem}.kiln"
    exe.save(out)
    print(f"compiled {args.model} for {exe.target} in {secs:.2f} s: "
          f"{len(exe.plan.regions)} regions -> {out}")
    return 0


def cmd_run(args) -> int:
    if args.model == "tiny-llama":
        return _run_llm(args)
    model, ex_args, exe, secs = _compile(args)
    print(f"compiled {args.model} for {exe.target} in {secs:.2f} s")
    t0 = time.perf_counter()
    out = exe(*ex_args)
    dt = time.perf_counter() - t0
    ref = model(*ex_args)
    for i, (o, r) in enumerate(zip(torch.utils._pytree.tree_leaves(out),
                                   torch.utils._pytree.tree_leaves(ref))):
        err = ((o.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()
        print(f"output {i}: {tuple(o.shape)} {o.dtype}  rel err vs eager {err:.2e}")
    print(f"run: {dt * 1e3:.2f} ms")
    return 0


def _run_llm(args) -> int:
    """The main job: compile the tiny Llama, prefill a prompt, decode a few tokens."""
    import copy

    import kiln
    from kiln.models import builtin

    model, ex_args, dynamic = builtin(args.model)
    eager = copy.deepcopy(model)
    t0 = time.perf_counter()
    exe = kiln.compile(model, ex_args, dynamic_shapes=dynamic, target=args.target)
    t_compile = time.perf_counter() - t0
    print(f"compiled {args.model} for {exe.target} in {t_compile:.2f} s: "
          f"{len(exe.plan.regions)} regions")
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, args.prompt_len), generator=gen)
    pos = torch.arange(args.prompt_len)
    t0 = time.perf_counter()
    logits = exe(prompt, pos)
    t_prefill = time.perf_counter() - t0
    ref = eager(prompt, pos)
    worst = ((logits - ref).norm() / ref.norm()).item()
    tokens = [int(logits[0, -1].argmax())]
    t_decode = []
    for i in range(args.steps - 1):
        tok = torch.tensor([[tokens[-1]]])
        p = torch.tensor([args.prompt_len + i])
        t0 = time.perf_counter()
        logits = exe(tok, p)
        t_decode.append(time.perf_counter() - t0)
        ref = eager(tok, p)
        worst = max(worst, ((logits - ref).norm() / ref.norm()).item())
        tokens.append(int(logits[0, -1].argmax()))
    print(f"prompt ({args.prompt_len} tokens): {prompt[0].tolist()}")
    print(f"generated ({len(tokens)} tokens): {tokens}")
    per_tok = sum(t_decode) / max(len(t_decode), 1)
    print(f"prefill: {t_prefill * 1e3:.2f} ms   decode: {per_tok * 1e3:.2f} ms/token "
          f"({1 / per_tok if per_tok else float('inf'):.1f} tok/s)")
    print(f"max relative error vs eager PyTorch: {worst:.2e}")
    return 0


def cmd_generate(args) -> int:
    """Load a checkpoint (or a preset with random weights), compile it, stream text."""
    from kiln.models import load

    if args.config is not None and not args.random_weights:
        raise KilnError("--config names a preset for --random-weights",
                        hint="add --random-weights, or load a checkpoint with --model DIR")
    source = args.model or (args.config if args.random_weights else None)
    if source is None:
        raise KilnError("name a checkpoint with --model DIR, or use --random-weights "
                        "--config NAME", hint="presets: tiny, llama3-8b, llama2-70b, ...")
    if not args.prompt:
        raise KilnError("give a prompt with --prompt TEXT (repeat it for a batch)")
    t0 = time.perf_counter()
    llm = load(source, dtype=args.dtype, target=args.target, max_seq_len=args.max_seq_len,
               max_batch_size=len(args.prompt), paged=args.cache == "paged",
               block_size=args.block_size, random_weights=args.random_weights,
               seed=args.seed)
    print(f"loaded {source} and compiled for {llm.target} in "
          f"{time.perf_counter() - t0:.2f} s", file=sys.stderr)
    stop = list(args.stop) + list(args.stop_id)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=stop,
                    ignore_eos=args.ignore_eos)
    prompts = args.prompt
    if len(prompts) == 1:
        sys.stdout.write(prompts[0])
        results = [llm.generate(prompts[0], on_text=_stream, **sampling)]
        print()
    else:
        results = llm.generate(prompts, **sampling)
        for p, r in zip(prompts, results):
            print(f"--- {p!r}\n{p}{r.text}")
    for r in results:
        print(r.summary(), file=sys.stderr)
    return 0


def _stream(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_explain(args) -> int:
    _, _, exe, _ = _compile(args)
    print(exe.describe(), end="")
    return 0


# ---- argument parsing ---------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="kiln: an ahead-of-time compiler "
                                "and runtime for LLM inference", epilog=EPILOG)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sp):
        sp.add_argument("model", help="path/to/file.py:factory or a built-in (tiny-llama)")
        sp.add_argument("--target", default="cpu",
                        help="cpu, cuda, cuda:sm_80|89|90|100, rocm:gfx942 (default: cpu)")
        sp.add_argument("-v", "--verbose", action="store_true", help="log every stage")

    c = sub.add_parser("compile", help="compile a model and save the artifact", epilog=EPILOG)
    common(c)
    c.add_argument("-o", "--output", help="artifact directory (default: <model>.kiln)")
    c.add_argument("--compile-to", choices=["import", "graph", "parallel", "dispatch", "codegen",
                                            "schedule"],
                   help="stop after this stage and print its IR")
    c.add_argument("--dump-ir", metavar="DIR", help="write the IR after every pass to DIR")
    c.set_defaults(fn=cmd_compile)

    r = sub.add_parser("run", help="compile (or load) a model and run it", epilog=EPILOG)
    common(r)
    r.add_argument("--prompt-len", type=int, default=16, help="LLMs: prompt tokens")
    r.add_argument("--steps", type=int, default=8, help="LLMs: tokens to generate")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(fn=cmd_run)

    g = sub.add_parser("generate", help="generate text from a Hugging Face checkpoint")
    g.add_argument("--model", help="checkpoint directory (config.json, *.safetensors, "
                   "tokenizer.json)")
    g.add_argument("--random-weights", action="store_true",
                   help="random weights: with --config NAME (a preset) or --model DIR's config")
    g.add_argument("--config", help="preset for --random-weights: tiny, llama3-8b, "
                   "llama3.1-8b, llama2-7b, llama2-70b")
    g.add_argument("--prompt", action="append", default=[],
                   help="prompt text (repeat for a batch)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-id", action="append", type=int, default=[],
                   help="stop token id (repeatable), besides the checkpoint's eos")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at eos")
    g.add_argument("--target", default="cpu", help="cpu, cuda, cuda:sm_90, ...")
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="default: the checkpoint's")
    g.add_argument("--max-seq-len", type=int, default=None,
                   help="context length (default: the model's, at most 4096)")
    g.add_argument("--cache", choices=["contiguous", "paged"], default="contiguous")
    g.add_argument("--block-size", type=int, default=16, help="paged cache block size")
    g.add_argument("-v", "--verbose", action="store_true", help="log every stage")
    g.set_defaults(fn=cmd_generate)

    e = sub.add_parser("explain", help="print the plan: regions, shapes, bounds, costs",
                       epilog=EPILOG)
    common(e)
    e.set_defaults(fn=cmd_explain)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:
        os.environ.setdefault("KILN_LOG", "all")
    _setup_logging()
    try:
        return args.fn(args)
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2


def _setup_logging() -> None:
    spec = os.environ.get("KILN_LOG")
    if not spec:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    names = ["kiln"] if spec == "all" else [f"kiln.{s.strip()}" for s in spec.split(",")]
    for n in names:
        lg = logging.getLogger(n)
        lg.setLevel(logging.INFO)
        lg.addHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
