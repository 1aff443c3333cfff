"""The `kiln` command line: its subcommands and their flags."""

from __future__ import annotations

import argparse

import torch

from kiln.bench.runners import RUNNERS
from kiln.cli.bench import cmd_bench
from kiln.cli.compile import cmd_compile
from kiln.cli.explain import cmd_explain
from kiln.cli.generate import cmd_generate
from kiln.cli.run import cmd_run
from kiln.pipeline import STAGES
from kiln.version import __version__

EPILOG = ("models: path/to/file.py:factory, or a built-in (tiny-llama); run and explain "
          "also take an artifact directory written by `kiln compile`")


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids like 1,2,3, got {text!r}") \
            from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids needs at least one id")
    return ids


def _size(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=N (e.g. seq=32), got {text!r}")
    return name.strip(), int(value)


def _add_model(sp, artifacts: bool, optional: bool = False) -> None:
    what = "path/to/file.py:factory or a built-in (tiny-llama)"
    sp.add_argument("model", metavar="MODEL|ARTIFACT" if artifacts else "MODEL",
                    nargs="?" if optional else None,
                    help=what + (", or an artifact directory from `kiln compile`"
                                 if artifacts else ""))
    sp.add_argument("--target", default=None,
                    help="cpu, cuda (this GPU), cuda:sm_80|86|89|90|100, rocm:gfx942, interpret "
                    "(default: cpu for a model; the artifact's own target for an artifact)")
    sp.add_argument("--fallback", choices=["allow", "error"], default="allow",
                    help="ops kiln has no kernel for: allow = run them as PyTorch's own ops "
                    "(a warning names each; default), error = refuse the model, listing them")
    sp.add_argument("-v", "--verbose", action="store_true",
                    help="log every stage to stderr (same as KILN_LOG=all)")


def _add_tune(sp) -> None:
    sp.add_argument("--tune", choices=["none", "fast", "full"], default=None,
                    help="autotuning of GPU kernels: none = heuristic config, no timing; "
                    "fast = a few candidates; full = the whole config space "
                    "(default: the autotuner's own)")


def _add_parallel(sp, how: str) -> None:
    sp.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="T",
                    help=f"split the model over T devices (tensor parallelism); {how}")
    sp.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1, metavar="P",
                    help="split the layers into P pipeline stages")


def _add_llm_compile(c) -> None:
    """`kiln compile --model DIR`: what the saved LLM is compiled for."""
    c.add_argument("--model", dest="checkpoint", metavar="DIR",
                   help="an LLM to compile for `kiln generate`: a Hugging Face checkpoint "
                   "directory or a preset with random weights (tiny, llama3-8b, ...)")
    c.add_argument("--random-weights", action="store_true",
                   help="--model DIR: random weights of its config.json")
    c.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="--model: default the checkpoint's")
    c.add_argument("--max-seq-len", type=int, default=None,
                   help="--model: context length (default: the model's, at most 4096)")
    c.add_argument("--max-batch-size", type=int, default=1,
                   help="--model: most prompts generated at once (default: 1)")
    c.add_argument("--cache", choices=["contiguous", "paged"], default="contiguous",
                   help="--model: the KV cache's layout")
    c.add_argument("--block-size", type=int, default=16, help="--model: paged cache block size")
    c.add_argument("--quantize", choices=["fp8"], default=None,
                   help="--model: the Llama families' projections as block-scaled fp8")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kiln", epilog=EPILOG,
        description="kiln: an ahead-of-time compiler and runtime for LLM inference. "
        "Compile a PyTorch model to an artifact, run it, or explain what was compiled.")
    p.add_argument("--version", action="version",
                   version=f"kiln {__version__} (torch {torch.__version__}, "
                   f"triton {_triton_version()})")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser(
        "compile", epilog=EPILOG, help="compile a model (or an LLM checkpoint) and save it",
        description="Compile MODEL for a target and save it as an artifact directory "
        "(manifest.json + weights.safetensors) that `kiln run` and kiln.load() use "
        "without recompiling. With --model DIR instead, compile an LLM checkpoint (or a "
        "preset) for generation and save it (prefill and decode modules, weights once, "
        "tokenizer, config) for `kiln generate ART` and kiln.models.load(ART).")
    _add_model(c, artifacts=False, optional=True)
    _add_llm_compile(c)
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
    _add_parallel(r, "kiln starts the T x P processes itself unless run under torchrun (a "
                  "multi-device artifact: its own T x P)")
    _add_tune(r)
    r.set_defaults(fn=cmd_run)

    g = sub.add_parser(
        "generate", help="generate text from a Hugging Face checkpoint or a compiled LLM",
        description="Load a Hugging Face checkpoint directory (config.json, *.safetensors, "
        "tokenizer.json: Llama 2/3/3.1, Mistral, Qwen2, Qwen3, Qwen3-Next and DeepSeek-V3 as "
        "kiln's own models, any other transformers causal LM, one sequence at a time, as "
        "transformers' model behind its static-cache recipe), or a preset with "
        "random weights, compile it with kiln and generate: text streams to stdout, a summary "
        "(time to first token, tokens/s) goes to stderr. Several --prompt run as a batch. "
        "An LLM saved by `kiln compile --model DIR -o ART` starts without compiling: "
        "`kiln generate ART --prompt ...`.")
    g.add_argument("artifact", nargs="?", metavar="ART",
                   help="a compiled LLM from `kiln compile --model DIR -o ART`")
    g.add_argument("--model", help="checkpoint directory (config.json, *.safetensors, "
                   "tokenizer.json), or a compiled LLM (ART)")
    g.add_argument("--random-weights", action="store_true",
                   help="random weights: with --config NAME (a preset) or --model DIR's config")
    g.add_argument("--config", help="preset for --random-weights: tiny, llama3-8b, "
                   "llama3.1-8b, llama2-7b, llama2-70b")
    g.add_argument("--prompt", action="append", default=[],
                   help="prompt text (repeat for a batch)")
    g.add_argument("--prompt-ids", action="append", default=[], type=_ids, metavar="ID,ID",
                   help="a prompt as token ids, e.g. 1,2,3 (repeatable; with --prompt a "
                   "batch); needs no tokenizer")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-id", action="append", type=int, default=[],
                   help="stop token id (repeatable), besides the checkpoint's eos")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at eos")
    g.add_argument("--target", default=None, help="cpu, cuda, cuda:sm_90, ... (default: cpu; "
                   "a compiled LLM's own)")
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="default: the checkpoint's")
    g.add_argument("--max-seq-len", type=int, default=None,
                   help="context length (default: the model's, at most 4096)")
    g.add_argument("--quantize", choices=["fp8"], default=None,
                   help="fp8: the projections of the Llama families and DeepSeek-V3 as "
                   "block-scaled fp8 weights (128x128 scales; activations quantised per "
                   "token; DeepSeek-V3's routed experts stay in --dtype)")
    g.add_argument("--keep-fp8", action=argparse.BooleanOptionalAction, default=None,
                   help="an fp8 checkpoint's projections stay fp8 (--keep-fp8) or are "
                   "dequantised at load (--no-keep-fp8, DeepSeek-V3 only); default: kept "
                   "on GPU targets, dequantised on the CPU")
    g.add_argument("--cache", choices=["contiguous", "paged"], default="contiguous")
    g.add_argument("--block-size", type=int, default=16, help="paged cache block size")
    _add_parallel(g, "kiln starts the T x P processes itself unless run under torchrun")
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
    e.add_argument("--timings", action="store_true",
                   help="also print where the compile's time went, phase by phase (a model "
                   "compiled now; an artifact has none)")
    _add_parallel(e, "compile-only: every rank's part is planned in this process, no "
                  "devices needed")
    e.add_argument("--rank", type=int, default=None, metavar="R",
                   help="with -tp/-pp: print rank R's whole report (regions included) "
                   "instead of every rank's weights, collectives and transfers")
    _add_tune(e)
    e.set_defaults(fn=cmd_explain)

    b = sub.add_parser(
        "bench", help="time kiln beside eager PyTorch and torch.compile, with the floors",
        description="Measure kiln, eager PyTorch and torch.compile on one gpt-fast-style "
        "Llama (random weights) in one run: prefill and decode at several lengths and batch "
        "sizes, kiln's decode throughput sweep, and the floors measured in the same run "
        "(copy bandwidth, a large matmul). Writes bench.txt, bench.json and bench.png; "
        "--check BASELINE exits 1 when a kiln figure is slower than the stored one.")
    b.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    b.add_argument("--preset", choices=["llama3-8b", "tiny"], default="llama3-8b")
    b.add_argument("--layers", type=int, default=None,
                   help="layers of the model (default: the preset's)")
    b.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="default: float16 on cuda, float32 on cpu")
    b.add_argument("--prefill", metavar="N,N",
                   help="prompt lengths (8b: 128,2048; '' for no prefill rows)")
    b.add_argument("--contexts", metavar="N,N",
                   help="decode contexts (8b: 128,2048; '' for no decode rows: with "
                   "--sweep '' a prefill-only run)")
    b.add_argument("--batches", metavar="B,B", help="batch sizes of every runner (8b: 1,4)")
    b.add_argument("--sweep", metavar="B,B",
                   help="kiln's decode throughput batch sizes (8b: 1,4,16,64; '' for none)")
    b.add_argument("--runners", default=",".join(RUNNERS),
                   help=f"which of {', '.join(RUNNERS)} to run (default: all)")
    b.add_argument("--quantize", choices=["fp8"], default=None,
                   help="also measure kiln on the model with block-scaled fp8 projections "
                   "(rows '... fp8' beside the dtype's, kiln's fp8 / dtype ratios; eager "
                   "runs its PyTorch fp8 form once, untimed, as the error's reference)")
    b.add_argument("--iters", type=int, default=20, help="timed calls per figure")
    b.add_argument("--out", default="kiln-bench", metavar="DIR",
                   help="where to write bench.txt / .json / .png (default: kiln-bench)")
    b.add_argument("--check", metavar="BASELINE.json",
                   help="exit 1 if a kiln figure is more than --tolerance slower than here")
    b.add_argument("--tolerance", type=float, default=0.05)
    b.add_argument("-v", "--verbose", action="store_true", help="log every stage")
    b.set_defaults(fn=cmd_bench)
    return p
