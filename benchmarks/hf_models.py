"""Models people bring: transformers causal LMs that kiln's zoo does not have, compiled
with `kiln.compile` as written (no kiln-specific code), against eager and torch.compile.

Why: kiln is a compiler, not a model zoo. The CPU sweep (NOTES.md) shows 56 of 57
transformers families match eager; this measures whether they are also fast on a GPU,
where transformers 5's MoE layers run their experts through a grouped GEMM by offsets
(aten._grouped_mm; kiln generates its own, templates/grouped_mm.py).

Each model: a few layers at a real model's widths, random weights, bf16, one forward over
`--tokens` tokens (`use_cache=False`); kiln and torch.compile each compile once (first
call timed), then the median of timed calls; error = ||out - eager|| / ||eager|| over the
logits.

`--decode`: the model through transformers' own static-cache export recipe
(TorchExportableModuleWithStaticCache: a KV cache of `--tokens` + 8 positions, its
forward taking input_ids and cache_position), as someone exporting an HF model would
write it: kiln compiles it twice, a prompt module (dynamic length) and a one-token module
replayed as CUDA graphs, both writing the recipe module's cache; eager runs the recipe
module, torch.compile the same module (mode "reduce-overhead": its CUDA graphs). Timed:
one decode step at position `--tokens` after the prompt; error over that step's logits;
on a GPU also the step's byte floor (`decode_bytes` at the run's copy bandwidth) and
kiln's ratio to it. probes/hf_decode_profile.py shows where such a step goes.

GPU:  PYTHONPATH=. python benchmarks/hf_models.py [--decode] [--attn eager] --out $OUT/x.json
CPU smoke: PYTHONPATH=. python benchmarks/hf_models.py --device cpu --small [--decode]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from measure import copy_bandwidth, rel_err, sync, timed_ms

import kiln

# name: (transformers class prefix, config kwargs at the real widths, layers)
MODELS = {
    "qwen3-moe-30b-a3b": ("Qwen3Moe", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, vocab_size=151936, norm_topk_prob=True), 4),
    "qwen3-8b": ("Qwen3", dict(
        hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936), 4),
    "llama3-8b": ("Llama", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0), 4),
    "llama2-7b": ("Llama", dict(  # multi-head attention: 32 KV heads
        hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000), 4),
    "mixtral-8x7b": ("Mixtral", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        vocab_size=32000), 2),
    # the decode recipe's families kiln has no model of (models/hf_recipe.py serves them)
    "gemma-2b": ("Gemma", dict(
        hidden_size=2048, intermediate_size=16384, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, vocab_size=256000), 4),
    "gemma2-2b": ("Gemma2", dict(
        hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000,
        attn_implementation="eager"), 4),  # softcapped scores: transformers has no sdpa form
    "phi3-mini": ("Phi3", dict(
        hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, pad_token_id=32000), 4),
    # LayerNorm families (norm with a mean and a bias; GPT-2's Conv1D weights are [in, out])
    "gpt2-medium": ("GPT2", dict(
        hidden_size=1024, num_attention_heads=16, vocab_size=50257), 4),
    "pythia-1.4b": ("GPTNeoX", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
        vocab_size=50304), 4),
    "stablelm-2-1.6b": ("StableLm", dict(
        hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=100352), 4),
    "starcoder2-3b": ("Starcoder2", dict(
        hidden_size=3072, intermediate_size=12288, num_attention_heads=24,
        num_key_value_heads=2, vocab_size=49152), 4),
}
SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
             num_local_experts=4, vocab_size=256, pad_token_id=None)


def build(name: str, small: bool, device: str, dtype, attn: str | None = None):
    import transformers

    prefix, kw, layers = MODELS[name]
    cls = getattr(transformers, f"{prefix}Config")
    if small:
        kw = {k: SMALL.get(k, v) for k, v in kw.items()}
    torch.manual_seed(0)
    kw = dict(kw)
    attn = attn or kw.pop("attn_implementation", "sdpa")
    kw.pop("attn_implementation", None)
    cfg = cls(num_hidden_layers=layers, **kw)
    cfg._attn_implementation = attn
    cls = (getattr(transformers, f"{prefix}ForCausalLM", None)
           or getattr(transformers, f"{prefix}LMHeadModel"))  # GPT-2's name
    model = cls(cfg)
    return model.to(device=device, dtype=dtype).eval()


def first_call_s(fn, device) -> float:
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def run(name: str, args) -> dict:
    dtype = getattr(torch, args.dtype)
    model = build(name, args.small, args.device, dtype, args.attn)
    vocab = model.config.vocab_size
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and args.tokens > positions:  # eager's own gather would assert
        raise ValueError(f"{args.tokens} tokens exceed {name}'s {positions} positions")
    ids = torch.randint(3, vocab, (1, args.tokens), device=args.device)
    row = {"model": name, "tokens": args.tokens, "dtype": args.dtype, "attn": args.attn,
           "layers": model.config.num_hidden_layers}
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        row["eager_ms"] = timed_ms(lambda: model(ids, use_cache=False), args.device)
        forms = {"kiln": None, "torch.compile": None}
        t0 = time.perf_counter()
        target = "cuda" if args.device == "cuda" else "cpu"
        forms["kiln"] = kiln.compile(model, (ids,), {"use_cache": False}, target=target)
        row["kiln_compile_s"] = time.perf_counter() - t0 + first_call_s(
            lambda: forms["kiln"](ids, use_cache=False), args.device)
        fallbacks = [r for r in forms["kiln"].plan.regions
                     if type(forms["kiln"].program.kplan.kernels[r.name]).__name__
                     == "TorchKernel" and any(o.target.startswith(("aten._grouped", "transf"))
                                              for o in r.ops)]
        row["kiln_grouped_as_torch"] = len(fallbacks)  # the tuner's choice, or why not
        row["kiln_grouped_notes"] = sorted({r.notes[-1][:300] for r in fallbacks if r.notes})
        if not args.skip_torch_compile:
            forms["torch.compile"] = torch.compile(model)
            row["torch_compile_s"] = first_call_s(
                lambda: forms["torch.compile"](ids, use_cache=False), args.device)
        for form, fn in forms.items():
            if fn is None:
                continue
            out = fn(ids, use_cache=False).logits
            key = form.replace(".", "_")
            row[f"{key}_rel_err"] = rel_err(out, ref)
            row[f"{key}_ms"] = timed_ms(lambda f=fn: f(ids, use_cache=False), args.device)
    if "torch_compile_ms" in row:
        row["kiln_vs_torch_compile"] = row["kiln_ms"] / row["torch_compile_ms"]
    row["kiln_vs_eager"] = row["kiln_ms"] / row["eager_ms"]
    return row


def decode_bytes(model, cache_len: int) -> int:
    """What one decode step must read: every weight once (the input embedding only when
    a separate head reads its own), and the static cache's K and V over all its rows."""
    params = {p.data_ptr(): p for p in model.parameters()}
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    embed = model.get_input_embeddings().weight
    if embed.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        nbytes -= embed.numel() * embed.element_size()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * kv_heads * head_dim * cache_len
    return nbytes + kv * embed.element_size()


def run_decode(name: str, args) -> dict:
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    dtype = getattr(torch, args.dtype)
    model = build(name, args.small, args.device, dtype, args.attn)
    model.generation_config.cache_implementation = "static"
    cache_len = args.tokens + 8

    def recipe():
        return TorchExportableModuleWithStaticCache(model, batch_size=1,
                                                    max_cache_len=cache_len,
                                                    device=args.device)

    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (1, args.tokens), device=args.device)
    pos0 = torch.arange(args.tokens, device=args.device)
    tok = torch.randint(3, vocab, (1, 1), device=args.device)
    pos = torch.tensor([args.tokens], device=args.device)
    row = {"model": name, "mode": "decode", "context": args.tokens, "dtype": args.dtype,
           "layers": model.config.num_hidden_layers}
    target = "cuda" if args.device == "cuda" else "cpu"
    with torch.no_grad():
        eager = recipe()
        eager(input_ids=prompt, cache_position=pos0)
        ref = eager(input_ids=tok, cache_position=pos)
        row["eager_ms"] = timed_ms(lambda: eager(input_ids=tok, cache_position=pos), args.device)
        mod = recipe()
        t0 = time.perf_counter()
        T = kiln.Dim("T", min=2, max=cache_len)
        fill = kiln.compile(mod, (), {"input_ids": prompt, "cache_position": pos0},
                            dynamic_shapes={"input_ids": {1: T}, "cache_position": {0: T}},
                            target=target)
        step = kiln.compile(mod, (), {"input_ids": tok, "cache_position": pos}, target=target)
        if args.device == "cuda":
            step = step.cuda_graphs()
        fill(input_ids=prompt, cache_position=pos0)
        out = step(input_ids=tok, cache_position=pos)
        sync(args.device)
        row["kiln_compile_s"] = time.perf_counter() - t0
        row["kiln_rel_err"] = rel_err(out, ref)
        row["kiln_ms"] = timed_ms(lambda: step(input_ids=tok, cache_position=pos), args.device)
        if not args.skip_torch_compile:
            tc_mod = recipe()
            tc = torch.compile(tc_mod, mode="reduce-overhead" if args.device == "cuda"
                               else None)
            tc_mod(input_ids=prompt, cache_position=pos0)
            row["torch_compile_s"] = first_call_s(
                lambda: tc(input_ids=tok, cache_position=pos), args.device)
            row["torch_compile_rel_err"] = rel_err(tc(input_ids=tok, cache_position=pos), ref)
            row["torch_compile_ms"] = timed_ms(lambda: tc(input_ids=tok, cache_position=pos),
                                               args.device)
            row["kiln_vs_torch_compile"] = row["kiln_ms"] / row["torch_compile_ms"]
    row["kiln_vs_eager"] = row["kiln_ms"] / row["eager_ms"]
    bw = copy_bandwidth(args.device)
    if bw:
        row["floor_ms"] = decode_bytes(model, cache_len) / bw * 1e3
        row["kiln_vs_floor"] = row["kiln_ms"] / row["floor_ms"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny widths (smoke test)")
    ap.add_argument("--skip-torch-compile", action="store_true")
    ap.add_argument("--decode", action="store_true",
                    help="a decode step through transformers' static-cache export recipe")
    ap.add_argument("--attn", choices=["sdpa", "eager"],
                    help="transformers' attention path for every model (default: sdpa, "
                         "eager where a model has no sdpa form); eager's attention written "
                         "out is what graph/eager_attention.py rewrites")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for name in args.models:
        try:
            rows.append((run_decode if args.decode else run)(name, args))
        except Exception as e:  # one model's failure is a result, not the end of the run
            rows.append({"model": name, "error": f"{type(e).__name__}: {e}"[:2000]})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda"
                       else "cpu", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
