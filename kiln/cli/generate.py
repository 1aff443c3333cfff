"""`kiln generate`: text from a checkpoint, a preset or a compiled LLM (kiln.models.LLM)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from kiln.errors import KilnError


def cmd_generate(args) -> int:
    """Load a checkpoint (or a preset with random weights), compile it, stream text."""
    from kiln.models import load
    from kiln.models.generate import check_sampling
    from kiln.models.saved_llm import is_saved_llm

    if args.artifact is not None:
        if args.model is not None:
            raise KilnError(f"name one model: {args.artifact} or --model {args.model}")
        args.model = args.artifact
    if args.config is not None and not args.random_weights:
        raise KilnError("--config names a preset for --random-weights",
                        hint="add --random-weights, or load a checkpoint with --model DIR")
    source = args.model or (args.config if args.random_weights else None)
    if source is None:
        raise KilnError("name a checkpoint with --model DIR, or use --random-weights "
                        "--config NAME", hint="presets: tiny, llama3-8b, llama2-70b, ...")
    prompts = list(args.prompt) + list(args.prompt_ids)
    if not prompts:
        raise KilnError("give a prompt with --prompt TEXT or --prompt-ids 1,2,3 (repeat "
                        "either for a batch)")
    _check_tokenizer(args)  # before minutes of compiling, not after
    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    t0 = time.perf_counter()
    llm = load(source, dtype=args.dtype, target=args.target, max_seq_len=args.max_seq_len,
               max_batch_size=len(prompts), paged=args.cache == "paged",
               block_size=args.block_size, random_weights=args.random_weights,
               seed=args.seed, cuda_graphs=False if args.no_cuda_graphs else None,
               tensor_parallel_size=args.tensor_parallel_size,
               pipeline_parallel_size=args.pipeline_parallel_size, quantize=args.quantize,
               keep_fp8=args.keep_fp8)
    if os.environ.get("RANK", "0") != "0":  # under torchrun: rank 0 prints for all
        _generate_quietly(llm, args)
        return 0
    secs = time.perf_counter() - t0
    if is_saved_llm(source):
        print(f"loaded {source} (compiled for {llm.target}) in {secs:.2f} s", file=sys.stderr)
    else:
        tip = "" if args.random_weights else \
            f" (`kiln compile --model {source} -o DIR` saves it compiled, to start in seconds)"
        print(f"loaded {source} and compiled for {llm.target} in {secs:.2f} s{tip}",
              file=sys.stderr)
    stop = list(args.stop) + list(args.stop_id)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=stop,
                    ignore_eos=args.ignore_eos)
    if len(prompts) == 1 and isinstance(prompts[0], str):
        sys.stdout.write(prompts[0])
        results = [llm.generate(prompts[0], on_text=_stream, **sampling)]
        print()
    else:
        results = llm.generate(prompts, **sampling)
        for p, r in zip(prompts, results):
            if isinstance(p, str):
                print(f"--- {p!r}\n{p}{r.text}")
            else:
                text = f"\n{r.text}" if r.text is not None else ""
                print(f"--- ids {','.join(map(str, p))}\n"
                      f"generated ids {','.join(map(str, r.ids))}{text}")
    for r in results:
        print(r.summary(), file=sys.stderr)
    return 0


def _check_tokenizer(args) -> None:
    """Text prompts need the checkpoint's tokenizer.json: say so before compiling."""
    if not args.prompt or args.random_weights or not args.model:
        return
    from kiln.errors import CheckpointError
    from kiln.models import hf

    path = Path(args.model)
    if not path.is_dir() or not (path / "config.json").is_file() or \
            (path / "tokenizer.json").is_file():
        return
    try:
        config = hf.read_json(path / "config.json")
        if config.get("model_type") != "deepseek_v3":
            hf.family(config, str(path))
    except CheckpointError:
        return  # loading says what is wrong with the checkpoint itself
    raise KilnError(f"{path} has no tokenizer.json, so text prompts cannot be encoded",
                    where=str(path),
                    hint="give the prompt as token ids with --prompt-ids 1,2,3, or copy "
                    "the model's tokenizer.json into the directory")


def _generate_quietly(llm, args) -> None:
    """Another rank's part of the same generation (every rank makes every call)."""
    stop = list(args.stop) + list(args.stop_id)
    every = list(args.prompt) + list(args.prompt_ids)
    prompts = every if len(every) > 1 else every[0]
    llm.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                 top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=stop,
                 ignore_eos=args.ignore_eos)


def _stream(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
