"""The `kiln` command: compile, run, explain (like iree-compile / iree-run-module).

A model is named as `path/to/file.py:factory` (a function returning (model, args),
(model, args, dynamic_shapes) or a dict with keys model, args, kwargs,
dynamic_shapes), as a built-in (`tiny-llama`), or, for run and explain, as a saved
artifact directory. Every KilnError ends the command with `kiln: error: ...` on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.utils._pytree as pytree

from kiln.errors import KilnError, user_frame
from kiln.pipeline import STAGES

EPILOG = ("models: path/to/file.py:factory, or a built-in (tiny-llama); run and explain "
          "also take an artifact directory written by `kiln compile`")


# ---- naming a model ---------------------------------------------------------------


@dataclass
class ModelSpec:
    model: torch.nn.Module
    args: tuple
    kwargs: dict = field(default_factory=dict)
    dynamic_shapes: object = None


def is_artifact(spec: str) -> bool:
    """An artifact directory (or a path that names one: it ends in .kiln)."""
    return ":" not in spec and (Path(spec).is_dir() or spec.rstrip("/").endswith(".kiln"))


def load_model_spec(spec: str) -> ModelSpec:
    """The model, example args and dynamic shapes named by 'file.py:factory' or a built-in."""
    from kiln.models import BUILTINS

    if spec in BUILTINS:
        return _as_model_spec(spec, BUILTINS[spec]())
    path, _, factory = spec.partition(":")
    if not factory or not path.endswith(".py"):
        raise KilnError(
            f"cannot read the model name {spec!r}",
            hint="name a model as path/to/file.py:factory, a built-in "
            f"({', '.join(BUILTINS)}), or (run/explain) an artifact directory",
        )
    if not Path(path).is_file():
        raise KilnError(f"model file {path} does not exist",
                        hint="check the path (it is relative to the current directory)")
    module = _import_file(path)
    fn = getattr(module, factory, None)
    if not callable(fn):
        found = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                 and getattr(v, "__module__", None) == module.__name__]
        raise KilnError(f"{path} has no function {factory!r}",
                        hint="functions defined there: " + (", ".join(found) or "none"))
    out = _call_user(lambda: fn(), f"calling {spec}")
    return _as_model_spec(spec, out)


def _import_file(path: str):
    mod_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(mod_spec)
    sys.path.insert(0, str(Path(path).resolve().parent))
    try:
        _call_user(lambda: mod_spec.loader.exec_module(module), f"importing {path}")
    finally:
        sys.path.pop(0)
    return module


def _call_user(fn, doing: str):
    """Run user code; its exceptions become a KilnError pointing at the user's line."""
    try:
        return fn()
    except KilnError:
        raise
    except Exception as e:
        tb = "".join(traceback.format_tb(e.__traceback__))
        where = user_frame(tb)
        if isinstance(e, SyntaxError):
            where = f"{e.filename}:{e.lineno}: {(e.text or '').strip()}"
        raise KilnError(f"{doing} failed: {type(e).__name__}: {e}", where=where,
                        hint="fix the model file; the error is in its code, not in kiln") \
            from None


def _as_model_spec(spec: str, out) -> ModelSpec:
    want = ("the factory must return (model, args), (model, args, dynamic_shapes) or a dict "
            "with keys model, args and optionally kwargs, dynamic_shapes")
    if isinstance(out, dict):
        if "model" not in out or "args" not in out:
            raise KilnError(f"{spec} returned a dict without 'model' and 'args'", hint=want)
        m = ModelSpec(out["model"], out["args"], dict(out.get("kwargs") or {}),
                      out.get("dynamic_shapes"))
    elif isinstance(out, tuple) and len(out) in (2, 3):
        m = ModelSpec(out[0], out[1], {}, out[2] if len(out) == 3 else None)
    else:
        raise KilnError(f"{spec} returned {type(out).__name__}", hint=want)
    if not isinstance(m.model, torch.nn.Module):
        raise KilnError(f"{spec} returned a {type(m.model).__name__} as its model",
                        hint="the model must be a torch.nn.Module; " + want)
    m.args = tuple(m.args) if isinstance(m.args, (list, tuple)) else (m.args,)
    return m


# ---- getting a compiled module ------------------------------------------------------


def _compile(args, spec: ModelSpec | None = None, **kw):
    import kiln

    spec = spec or load_model_spec(args.model)
    options = {"tune": args.tune} if getattr(args, "tune", None) else None
    t0 = time.perf_counter()
    exe = kiln.compile(spec.model, spec.args, spec.kwargs, dynamic_shapes=spec.dynamic_shapes,
                       target=args.target or "cpu", options=options, **kw)
    return exe, time.perf_counter() - t0


def _load(args):
    import kiln

    t0 = time.perf_counter()
    exe = kiln.load(args.model, target=args.target)
    return exe, time.perf_counter() - t0


def _module(args):
    """(compiled module, seconds, what it came from): an artifact is loaded, a model compiled."""
    if is_artifact(args.model):
        exe, secs = _load(args)
        return exe, secs, "loaded"
    exe, secs = _compile(args)
    return exe, secs, "compiled"


# ---- kiln compile -------------------------------------------------------------------


def cmd_compile(args) -> int:
    from kiln.api import CompiledModule
    from kiln.ir.printer import print_ir

    if is_artifact(args.model):
        raise KilnError(f"{args.model} is an artifact, already compiled",
                        hint=f"run it with `kiln run {args.model}` or inspect it with "
                        f"`kiln explain {args.model}`")
    exe, secs = _compile(args, compile_to=args.compile_to, dump_ir=args.dump_ir)
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


# ---- kiln run -----------------------------------------------------------------------


def cmd_run(args) -> int:
    from kiln.models import BUILTINS

    if is_artifact(args.model):
        exe, secs = _load(args)
        print(f"loaded {args.model} ({exe.target}, {len(exe.plan.regions)} regions) "
              f"in {secs:.2f} s")
        call_args, call_kwargs = _random_call(exe, args)
        return _time_and_report(exe, call_args, call_kwargs, args, reference=None)
    spec = load_model_spec(args.model)
    if args.model in BUILTINS and _is_llm(spec.model) and not args.size:
        return _run_llm(args, spec)
    eager = copy.deepcopy(spec.model)  # the compiled module shares (and updates) its buffers
    exe, secs = _compile(args, spec)
    print(f"compiled {args.model} for {exe.target} in {secs:.2f} s: "
          f"{len(exe.plan.regions)} regions")
    if args.size:
        call_args, call_kwargs = _random_call(exe, args)
    else:
        call_args, call_kwargs = spec.args, spec.kwargs
        print("inputs: the factory's example args")
    return _time_and_report(exe, call_args, call_kwargs, args, reference=eager)


def _random_call(exe, args):
    from kiln.artifact.inputs import random_inputs, sizes_for

    env = sizes_for(exe, dict(args.size or []))
    named = {sym: name for name, sym in exe.dim_names.items()}
    if env:
        print("sizes: " + ", ".join(f"{named.get(s, s)}={v}" for s, v in sorted(env.items())))
    print(f"inputs: random (seed {args.seed})")
    return random_inputs(exe, env, args.seed)


def _time_and_report(exe, call_args, call_kwargs, args, reference) -> int:
    """Call `exe` 1 + --repeat times; summarise the first call's outputs (vs eager)."""
    times, first = [], None
    for _ in range(1 + max(args.repeat, 0)):
        t0 = time.perf_counter()
        out = exe(*call_args, **call_kwargs)
        if exe.program.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        first = out if first is None else first
    ref = reference(*call_args, **call_kwargs) if reference is not None else None
    _print_outputs(first, ref)
    line = f"first call: {times[0] * 1e3:.2f} ms"
    if len(times) > 1:
        line += f"   then median of {len(times) - 1}: {statistics.median(times[1:]) * 1e3:.2f} ms"
    print(line)
    return 0


def _print_outputs(out, ref) -> None:
    leaves, _ = pytree.tree_flatten_with_path(out)
    refs = pytree.tree_leaves(ref) if ref is not None else [None] * len(leaves)
    for (path, o), r in zip(leaves, refs):
        name = "output" + pytree.keystr(path)
        if not isinstance(o, torch.Tensor):
            print(f"{name}: {o!r}")
            continue
        line = f"{name}: {_summary(o)}"
        if isinstance(r, torch.Tensor) and o.is_floating_point():
            err = ((o.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30)).item()
            line += f"   rel err vs eager {err:.2e}"
        elif isinstance(r, torch.Tensor):
            same = torch.equal(o.cpu(), r.cpu())
            line += "   equal to eager" if same else "   DIFFERS from eager"
        print(line)


def _summary(t: torch.Tensor) -> str:
    from kiln.ir.printer import type_str

    head = type_str(list(t.shape), t.dtype)
    if t.numel() == 0:
        return head + " (empty)"
    x = t.detach().double()
    finite = x[torch.isfinite(x)]
    bad = x.numel() - finite.numel()
    if finite.numel() == 0:
        return f"{head}  (no finite values)"
    std = finite.std().item() if finite.numel() > 1 else 0.0
    stats = (f"mean {finite.mean().item():.4g}  std {std:.4g}  min {finite.min().item():.4g}  "
             f"max {finite.max().item():.4g}")
    return f"{head}  {stats}" + (f"  ({bad} not finite)" if bad else "")


def _is_llm(model) -> bool:
    return hasattr(getattr(model, "cfg", None), "vocab_size")


def _run_llm(args, spec: ModelSpec) -> int:
    """The main job: compile a built-in LLM, prefill a prompt, decode a few tokens."""
    model = spec.model
    eager = copy.deepcopy(model)
    exe, t_compile = _compile(args, spec)
    print(f"compiled {args.model} for {exe.target} in {t_compile:.2f} s: "
          f"{len(exe.plan.regions)} regions")
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, args.prompt_len), generator=gen)
    pos = torch.arange(args.prompt_len)
    t0 = time.perf_counter()
    exe(prompt, pos)  # the first call also lays out memory and loads kernels
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits = exe(prompt, pos)  # the same prefill again (it rewrites the same cache rows)
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
    print(f"first call: {t_first * 1e3:.2f} ms   prefill: {t_prefill * 1e3:.2f} ms   "
          f"decode: {per_tok * 1e3:.2f} ms/token "
          f"({1 / per_tok if per_tok else float('inf'):.1f} tok/s)")
    print(f"max relative error vs eager PyTorch: {worst:.2e}")
    return 0


# ---- kiln generate ------------------------------------------------------------------


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
               seed=args.seed, cuda_graphs=False if args.no_cuda_graphs else None)
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


# ---- kiln explain -------------------------------------------------------------------


def cmd_explain(args) -> int:
    exe, secs, how = _module(args)
    print(exe.explain(kernels=args.kernels), end="")
    print(f"# {how} in {secs:.2f} s", file=sys.stderr)
    return 0


# ---- argument parsing ---------------------------------------------------------------


def _size(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=N (e.g. seq=32), got {text!r}")
    return name.strip(), int(value)


def _add_model(sp, artifacts: bool) -> None:
    what = "path/to/file.py:factory or a built-in (tiny-llama)"
    sp.add_argument("model", metavar="MODEL|ARTIFACT" if artifacts else "MODEL",
                    help=what + (", or an artifact directory from `kiln compile`"
                                 if artifacts else ""))
    sp.add_argument("--target", default=None,
                    help="cpu, cuda (this GPU), cuda:sm_80|86|89|90|100, rocm:gfx942, interpret "
                    "(default: cpu for a model; the artifact's own target for an artifact)")
    sp.add_argument("-v", "--verbose", action="store_true",
                    help="log every stage to stderr (same as KILN_LOG=all)")


def _add_tune(sp) -> None:
    sp.add_argument("--tune", choices=["none", "fast", "full"], default=None,
                    help="autotuning of GPU kernels: none = heuristic config, no timing; "
                    "fast = a few candidates; full = the whole config space "
                    "(default: the autotuner's own)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kiln", epilog=EPILOG,
        description="kiln: an ahead-of-time compiler and runtime for LLM inference. "
        "Compile a PyTorch model to an artifact, run it, or explain what was compiled.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser(
        "compile", epilog=EPILOG, help="compile a model and save the artifact",
        description="Compile MODEL for a target and save it as an artifact directory "
        "(manifest.json + weights.safetensors) that `kiln run` and kiln.load() use "
        "without recompiling.")
    _add_model(c, artifacts=False)
    c.add_argument("-o", "--output", metavar="DIR",
                   help="artifact directory to write (default: <model>.kiln)")
    c.add_argument("--compile-to", choices=list(STAGES), metavar="STAGE",
                   help="stop after this stage and print its IR instead of saving "
                   f"({', '.join(STAGES)})")
    c.add_argument("--dump-ir", metavar="DIR", help="write the IR after every pass into DIR")
    _add_tune(c)
    c.set_defaults(fn=cmd_compile)

    r = sub.add_parser(
        "run", epilog=EPILOG, help="run a model or an artifact and time it",
        description="Run MODEL (compiled now) or ARTIFACT (loaded) and print a summary of "
        "its outputs and timings. An artifact runs on random inputs matching its "
        "signature; a model runs on its example args (compared with eager PyTorch), or on "
        "random inputs when --size is given. The built-in LLMs run a prefill and decode "
        "steps instead.")
    _add_model(r, artifacts=True)
    r.add_argument("--size", type=_size, action="append", metavar="NAME=N",
                   help="size of a dynamic dim, by its torch.export.Dim name or symbol "
                   "(repeatable; default: the example's size, else the lower bound)")
    r.add_argument("--repeat", type=int, default=3, metavar="N",
                   help="timed calls after the first (default: 3)")
    r.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    r.add_argument("--prompt-len", type=int, default=16, help="built-in LLMs: prompt tokens")
    r.add_argument("--steps", type=int, default=8, help="built-in LLMs: tokens to generate")
    _add_tune(r)
    r.set_defaults(fn=cmd_run)

    g = sub.add_parser(
        "generate", help="generate text from a Hugging Face checkpoint",
        description="Load a Hugging Face checkpoint directory (Llama 2/3/3.1, Mistral, "
        "Qwen2: config.json, *.safetensors, tokenizer.json), or a preset with random "
        "weights, compile it with kiln and generate: text streams to stdout, a summary "
        "(time to first token, tokens/s) goes to stderr. Several --prompt run as a batch.")
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
    g.add_argument("--no-cuda-graphs", action="store_true",
                   help="GPU: run decode steps without CUDA graphs (default: graphs on)")
    g.add_argument("-v", "--verbose", action="store_true", help="log every stage")
    g.set_defaults(fn=cmd_generate)

    e = sub.add_parser(
        "explain", epilog=EPILOG, help="print the plan: regions, shapes, bounds, costs, memory",
        description="Explain what kiln compiled: each region's kind, symbolic shapes, the "
        "source lines it came from, why it is extern or was split, bytes moved and flops "
        "at the example sizes and the upper bounds; the size symbols and their bounds; "
        "totals; and the memory plan's peak against the sum of all intermediates.")
    _add_model(e, artifacts=True)
    e.add_argument("--kernels", action="store_true",
                   help="also print each region's kernel (the Triton source of Triton kernels)")
    _add_tune(e)
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
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130


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
        if not any(getattr(h, "_kiln_cli", False) for h in lg.handlers):
            handler._kiln_cli = True
            lg.addHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
