"""`kiln run` on a built-in LLM: generate with kiln.models.LLM, check against eager.

The LLM compiles a prefill and a decode module and runs its own generation loop;
this command only picks a random prompt, reports timings, and replays the prompt and
the generated tokens through both the compiled modules and eager PyTorch, timing both
alike (kiln's and eager's time per token side by side) and reporting the worst
relative error of the logits.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from kiln.cli.model_spec import ModelSpec, compile_options
from kiln.cli.timing import timed_calls, to_device, versus
from kiln.errors import ArgumentError
from kiln.models.generate import LLM
from kiln.target import get_target


def is_llm(model) -> bool:
    return hasattr(getattr(model, "cfg", None), "vocab_size")


def run_llm(args, spec: ModelSpec) -> int:
    """Compile a built-in LLM, prefill a random prompt, decode --steps tokens greedily."""
    for flag, value in (("--prompt-len", args.prompt_len), ("--steps", args.steps)):
        if value < 1:
            raise ArgumentError(f"{flag} must be at least 1, got {value}")
    if args.prompt_len > spec.model.cfg.max_seq_len:
        raise ArgumentError(f"--prompt-len {args.prompt_len} exceeds {args.model}'s context "
                            f"of {spec.model.cfg.max_seq_len} positions")
    eager = copy.deepcopy(spec.model)  # the LLM shares (and updates) the model's KV cache
    target = get_target(args.target or "cpu")
    model = spec.model
    if target.is_gpu and torch.cuda.is_available():
        model = model.to(target.torch_device)  # the LLM runs the model where it lives
    t0 = time.perf_counter()
    llm = LLM(model, target=target, name=args.model,
              compile_options=compile_options(args), parallel=args.parallel)
    print(f"compiled {args.model} for {llm.target} in {time.perf_counter() - t0:.2f} s: "
          f"{len(llm.prefill_module.plan.regions)} regions "
          f"(decode: {len(llm.decode_module.plan.regions)})")
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, llm.cfg.vocab_size, (1, args.prompt_len), generator=gen)
    t0 = time.perf_counter()
    llm.forward(prompt, torch.arange(args.prompt_len))  # the first call at this length
    t_first = time.perf_counter() - t0
    result = llm.generate(prompt[0].tolist(), max_new_tokens=args.steps, ignore_eos=True)
    tokens = result.ids
    print(f"prompt ({args.prompt_len} tokens): {prompt[0].tolist()}")
    print(f"generated ({len(tokens)} tokens): {tokens}")
    if result.finish_reason == "context":
        print(f"note: stopped after {len(tokens)} of {args.steps} tokens: the model's context "
              f"is {llm.max_seq_len} positions (--prompt-len {args.prompt_len} + --steps "
              f"{args.steps} exceeds it)")
    per_tok = result.decode_s / max(len(tokens) - 1, 1)
    print(f"first call: {t_first * 1e3:.2f} ms   "
          f"prefill: {result.time_to_first_token_s * 1e3:.2f} ms   "
          f"decode: {per_tok * 1e3:.2f} ms/token "
          f"({1 / per_tok if per_tok else float('inf'):.1f} tok/s)")
    replay = _replay(llm, eager, prompt, tokens)
    print(versus(f"prefill ({args.prompt_len} tokens, same prompt)", replay.kiln_prefill,
                 replay.eager_prefill))
    if replay.kiln_decode:
        print(versus(f"decode per token (median of {len(replay.kiln_decode)} steps, same "
                     "tokens)", replay.kiln_decode, replay.eager_decode))
    print(f"max relative error vs eager PyTorch: {replay.worst:.2e}")
    return 0


@dataclass
class Replay:
    worst: float  # the worst relative error of the logits
    kiln_prefill: list[float]  # seconds
    eager_prefill: list[float]
    kiln_decode: list[float]  # one per decode step
    eager_decode: list[float]


def _replay(llm: LLM, eager, prompt: torch.Tensor, tokens: list[int]) -> Replay:
    """Replay the prompt (prefill) and each generated token but the last (decode steps)
    through the compiled modules and eager PyTorch, timing every call alike; the worst
    relative error. Each side's prefill runs twice (it rewrites the same positions), the
    second timed: eager's first call would time PyTorch warming up."""
    def err(got, ref):
        got, ref = got.double().cpu(), ref.double().cpu()
        return ((got - ref).norm() / ref.norm()).item()

    device = llm.device
    eager = eager.to(device) if device.type != "cpu" else eager
    n = prompt.shape[1]
    pos = torch.arange(n)
    got, k_pre = timed_calls(lambda: llm.forward(prompt, pos), 2, device)
    ref, e_pre = timed_calls(lambda: eager(*to_device((prompt, pos), device)), 2, device)
    out = Replay(err(got, ref), k_pre[1:], e_pre[1:], [], [])
    for i, tok in enumerate(tokens[:-1]):
        t, p = torch.tensor([[tok]]), torch.tensor([n + i])
        got, k = timed_calls(lambda: llm.forward(t, p), 1, device)  # noqa: B023 - called now
        ref, e = timed_calls(lambda: eager(*to_device((t, p), device)), 1, device)  # noqa: B023
        out.worst = max(out.worst, err(got, ref))
        out.kiln_decode += k
        out.eager_decode += e
    return out
