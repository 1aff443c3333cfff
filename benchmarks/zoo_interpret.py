"""transformers causal LMs through their static-cache export recipe, on kiln's generated
kernels (the `interpret` target: Triton's CPU interpreter) beside the CPU target.

Why: the CPU target runs each region as PyTorch ops, so a family that matches there says
nothing about the Triton kernels kiln writes for its attention / norm / rotary variant.
Each family: a tiny random config; the recipe module (TorchExportableModuleWithStaticCache)
compiled twice as README shows (a prompt module with a dynamic length, a one-token module,
both writing the recipe's cache); a prefill of `--prompt` tokens (not the example's
length) and 2 decode steps, against a second recipe module run eagerly with its own
cache; the worst relative error of the logits over the three calls. bf16 rows (`--dtype
bfloat16`) also give the error against an fp32 eager reference (eager bf16's own beside).

    PYTHONPATH=. python benchmarks/zoo_interpret.py [--only llama,gemma2] [--dtype bfloat16]
        [--targets cpu,interpret] [--attn eager] [--prompt 19 --cache-len 32]
        [--head-dim 80 --heads 2 --kv-heads 1 --vocab 100] [--window 5] [--batch 2]
        [--experts 6] [--config K] [--list]

Results and what each setting found: tests/fuzz/FINDINGS.md ("static-cache recipe on
the generated kernels").
"""

from __future__ import annotations

import argparse
import time
import traceback
import warnings

import torch

import kiln
from kiln.errors import KilnWarning

# the tiny widths (--head-dim etc. change them: odd head dims as Phi-3's 96, a vocabulary
# that is no power of two); hidden = heads * head_dim
SIZES = dict(heads=4, kv_heads=2, head_dim=16, inter=128, vocab=128, window=4, batch=1,
             experts=4)


def base(style: str) -> dict:
    """The config kwargs of one naming style at SIZES."""
    z = SIZES
    hidden = z["heads"] * z["head_dim"]
    if style == "gpt":
        return dict(n_embd=hidden, n_layer=2, n_head=z["heads"], n_positions=64,
                    vocab_size=z["vocab"], bos_token_id=1, eos_token_id=2)
    if style == "mpt":
        return dict(d_model=hidden, n_heads=z["heads"], n_layers=2, vocab_size=z["vocab"],
                    max_seq_len=64)
    return dict(hidden_size=hidden, intermediate_size=z["inter"], num_hidden_layers=2,
                num_attention_heads=z["heads"], num_key_value_heads=z["kv_heads"],
                head_dim=z["head_dim"], vocab_size=z["vocab"], max_position_embeddings=64,
                pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


SLIDE = ["sliding_attention", "full_attention"]

# family: (model class, config class, config kwargs over base("hf"), or over another
# style's named by "_own"; None drops a key), what the family exercises
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}, "RoPE, GQA, RMSNorm, SwiGLU"),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": 4},
                "sliding window"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}, "qkv bias"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {}, "q/k RMSNorm"),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", {}, "gelu, scaled embedding, 1+w norm"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {
        "sliding_window": 4, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
        "layer_types": SLIDE}, "logit soft-capping, alternating window"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", {
        "sliding_window": 4, "layer_types": SLIDE}, "q/k norm, local/global rope"),
    "phi": ("PhiForCausalLM", "PhiConfig", {"partial_rotary_factor": 0.5, "head_dim": None,
                                            "num_key_value_heads": None},
            "partial rotary, parallel block, LayerNorm"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {}, "fused qkv / gate_up"),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {
        "rotary_pct": 0.5, "num_key_value_heads": None, "head_dim": None},
        "partial rotary, parallel residual"),
    "gptj": ("GPTJForCausalLM", "GPTJConfig", {"_own": "gpt", "rotary_dim": 8},
             "interleaved rotary"),
    "falcon": ("FalconForCausalLM", "FalconConfig", {
        "num_key_value_heads": None, "head_dim": None}, "MQA, parallel attention"),
    "falcon_new": ("FalconForCausalLM", "FalconConfig", {
        "new_decoder_architecture": True, "num_kv_heads": 2, "num_key_value_heads": None,
        "head_dim": None}, "new decoder architecture, GQA"),
    "bloom": ("BloomForCausalLM", "BloomConfig", {
        "num_key_value_heads": None, "head_dim": None, "n_layer": 2, "n_head": 4},
        "ALiBi"),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {"_own": "gpt"}, "learned positions, "
             "Conv1D"),
    "gpt_bigcode": ("GPTBigCodeForCausalLM", "GPTBigCodeConfig", {
        "_own": "gpt", "multi_query": True}, "MQA"),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", {
        "partial_rotary_factor": 0.25, "use_qkv_bias": True, "head_dim": None},
        "partial rotary, LayerNorm, qkv bias"),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", {
        "sliding_window": 4, "head_dim": None}, "LayerNorm, bias, gelu MLP, window"),
    "olmo": ("OlmoForCausalLM", "OlmoConfig", {"clip_qkv": 0.5}, "parameter-free norm, "
             "qkv clipping"),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", {}, "post-norm, q/k norm over heads"),
    "cohere": ("CohereForCausalLM", "CohereConfig", {"logit_scale": 0.5, "use_qk_norm": True},
               "interleaved rotary, logit scale, LayerNorm, q/k norm"),
    "granite": ("GraniteForCausalLM", "GraniteConfig", {
        "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
        "attention_multiplier": 0.1, "logits_scaling": 4.0}, "multipliers"),
    "nemotron": ("NemotronForCausalLM", "NemotronConfig", {"partial_rotary_factor": 0.5},
                 "LayerNorm1p, relu2, partial rotary"),
    "persimmon": ("PersimmonForCausalLM", "PersimmonConfig", {
        "num_key_value_heads": None, "head_dim": None, "qk_layernorm": True,
        "partial_rotary_factor": 0.5}, "fused qkv, q/k LayerNorm, relu2"),
    "codegen": ("CodeGenForCausalLM", "CodeGenConfig", {
        "_own": "gpt", "rotary_dim": 8, "n_ctx": 64}, "fused qkv, interleaved rotary"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}, "MoE"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True}, "MoE, q/k norm"),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
        "layer_types": SLIDE}, "attention sinks, window, clamped SwiGLU MoE"),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", {
        "no_rope_layers": [1, 0]}, "a no-RoPE layer"),
    "exaone4": ("Exaone4ForCausalLM", "Exaone4Config", {
        "sliding_window": 4, "layer_types": SLIDE}, "post-norm, q/k norm, window"),
    "glm": ("GlmForCausalLM", "GlmConfig", {"partial_rotary_factor": 0.5},
            "partial interleaved rotary"),
    "cohere2": ("Cohere2ForCausalLM", "Cohere2Config", {
        "sliding_window": 4, "layer_types": SLIDE}, "window, no-RoPE global layer"),
    "falcon_alibi": ("FalconForCausalLM", "FalconConfig", {
        "alibi": True, "multi_query": False, "num_key_value_heads": None, "head_dim": None},
        "ALiBi, parallel attention"),
    "mpt": ("MptForCausalLM", "MptConfig", {"_own": "mpt", "use_cache": True},
        "ALiBi sliced from a table, no bias"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64}, "MoE, sigmoid-gated shared expert"),
    "diffllama": ("DiffLlamaForCausalLM", "DiffLlamaConfig", {},
                  "differential attention (two softmaxes)"),
    "apertus": ("ApertusForCausalLM", "ApertusConfig", {}, "xIELU, q/k norm"),
    "vaultgemma": ("VaultGemmaForCausalLM", "VaultGemmaConfig", {
        "sliding_window": 4, "layer_types": SLIDE}, "soft-capping, window"),
}


def pin_config(k: int | None) -> None:
    """Run candidate `k` (mod each spec's count) of every kernel on the interpret target,
    not the spec's default: the GPU targets' tuner picks others (split keys, other tiles),
    which the interpreter otherwise never runs. None: the defaults again."""
    import kiln.codegen.select_kernels as sk
    from kiln.codegen.autotune.tuner import choose
    from kiln.codegen.build.triton_kernel import TritonKernel

    def pinned(region, spec, target, ctx, plan=None, tuner=None):
        if target.backend == "interpret" and spec.configs:
            # warps and stages change nothing the interpreter computes: one of each tiling
            distinct = list({tuple(sorted(c.as_dict().items())): c
                             for c in spec.configs}.values())
            return TritonKernel(region, spec, distinct[k % len(distinct)], interpret=True)
        return choose(region, spec, target, ctx, plan, tuner)

    sk.choose = choose if k is None else pinned


def build(name: str, dtype, attn: str = "sdpa"):
    import transformers

    cls, cfg_cls, extra, _ = FAMILIES[name]
    extra = dict(extra)
    kw = base(extra.pop("_own", "hf"))
    kw.update(extra)
    if kw.get("sliding_window"):
        kw["sliding_window"] = SIZES["window"]
    for key in ("num_local_experts", "num_experts"):
        if key in kw:
            kw[key] = SIZES["experts"]
    kw = {k: v for k, v in kw.items() if v is not None}
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**kw)
    cfg._attn_implementation = attn
    try:
        model = getattr(transformers, cls)(cfg).eval()
    except ValueError as e:  # Gemma 2, BLOOM, GPT-OSS: eager attention only
        if "attention implementation" not in str(e):
            raise
        cfg._attn_implementation = "eager"
        model = getattr(transformers, cls)(cfg).eval()
    with torch.no_grad():  # tiny random weights leave the logits near zero: spread them
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    model.generation_config.cache_implementation = "static"
    return model.to(dtype)


def recipe(model, cache_len: int):
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    device = next(model.parameters()).device  # the cache beside the weights
    return TorchExportableModuleWithStaticCache(model, batch_size=SIZES["batch"],
                                                max_cache_len=cache_len, device=str(device))


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def calls(vocab: int, prompt: int, device="cpu"):
    """The prefill and the two decode steps' keyword arguments."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (SIZES["batch"], prompt + 2), generator=g).to(device)
    out = [{"input_ids": ids[:, :prompt].contiguous(),
            "cache_position": torch.arange(prompt, device=device)}]
    out += [{"input_ids": ids[:, prompt + i:prompt + i + 1].contiguous(),
             "cache_position": torch.tensor([prompt + i], device=device)} for i in range(2)]
    return out


def eager_logits(model, steps, cache_len) -> list[torch.Tensor]:
    m = recipe(model, cache_len)
    with torch.no_grad():
        return [m(**kw) for kw in steps]


def kiln_logits(model, steps, cache_len, target, example_len, cache) -> list[torch.Tensor]:
    m = recipe(model, cache_len)
    vocab = model.config.vocab_size
    ex = calls(vocab, example_len, next(model.parameters()).device)
    T = kiln.Dim("T", min=2, max=cache_len)
    opts = {} if cache else {"compile_cache": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KilnWarning)
        fill = kiln.compile(m, (), ex[0], dynamic_shapes={"input_ids": {1: T},
                                                          "cache_position": {0: T}},
                            target=target, options=opts)
        step = kiln.compile(m, (), ex[1], target=target, options=opts)
    with torch.no_grad():
        return [fill(**steps[0])] + [step(**kw) for kw in steps[1:]]


def run_one(name, target, args, refs) -> tuple[str, float]:
    """(result, seconds): 'ok 1.2e-07', 'MISMATCH 3e-01' or the error's first line."""
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    try:
        model = build(name, dtype, args.attn)
        steps = calls(model.config.vocab_size, args.prompt)
        outs = kiln_logits(model, steps, args.cache_len, target, args.prompt + 1, args.cache)
        err = max(rel(o, r) for o, r in zip(outs, refs["eager"]))
        text = f"{err:.1e}"
        if "fp32" in refs:  # bf16: kiln's error against fp32 beside eager bf16's
            f32 = max(rel(o, r) for o, r in zip(outs, refs["fp32"]))
            e32 = max(rel(o, r) for o, r in zip(refs["eager"], refs["fp32"]))
            text += f" (fp32 ref {f32:.1e}, eager {e32:.1e})"
            ok = err < args.tol or f32 < 2 * e32 + args.tol
        else:
            ok = err < args.tol
        result = ("ok " if ok else "MISMATCH ") + text
    except Exception as e:  # one family's failure is a row of the table
        if args.verbose:
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        result = f"{type(e).__name__}: {first}"[:110]
    return result, time.perf_counter() - t0


def references(name, args) -> dict:
    dtype = getattr(torch, args.dtype)
    model = build(name, dtype, args.attn)
    steps = calls(model.config.vocab_size, args.prompt)
    refs = {"eager": eager_logits(model, steps, args.cache_len)}
    if dtype != torch.float32:
        refs["fp32"] = eager_logits(build(name, torch.float32, args.attn), steps,
                                    args.cache_len)
    return refs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="comma-separated families")
    p.add_argument("--targets", default="cpu,interpret")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt", type=int, default=5, help="prefill length (example: +1)")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"),
                   help="transformers' attention implementation (eager: matmul, "
                   "softmax, matmul with an additive mask)")
    p.add_argument("--cache-len", type=int, default=16)
    p.add_argument("--tol", type=float, default=None, help="fp32 1e-5, else 1e-2")
    p.add_argument("--cache", action="store_true", help="use kiln's compile cache")
    p.add_argument("--verbose", action="store_true", help="print each error's traceback")
    for k, v in SIZES.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--config", type=int, default=None,
                   help="interpret: every kernel runs tiling K of its spec's candidates "
                   "(mod their count), not the default")
    p.add_argument("--list", action="store_true")
    args = p.parse_args()
    SIZES.update({k: getattr(args, k) for k in SIZES})
    pin_config(args.config)
    if args.tol is None:
        args.tol = 1e-5 if args.dtype == "float32" else 1e-2
    names = [n for n in args.only.split(",") if n] or list(FAMILIES)
    if args.list:
        for n in names:
            print(f"{n:12} {FAMILIES[n][3]}")
        return
    targets = args.targets.split(",")
    print(f"{'family':12}" + "".join(f"{t + ' result':44}{'s':>6}  " for t in targets),
          flush=True)
    counts = {t: {"ok": 0, "MISMATCH": 0, "error": 0} for t in targets}
    for name in names:
        try:
            refs = references(name, args)
        except Exception as e:
            print(f"{name:12}eager recipe fails: {type(e).__name__}: {str(e)[:80]}",
                  flush=True)
            continue
        line = f"{name:12}"
        for t in targets:
            result, secs = run_one(name, t, args, refs)
            kind = result.split()[0] if result.split()[0] in ("ok", "MISMATCH") else "error"
            counts[t][kind] += 1
            line += f"{result:44}{secs:6.1f}  "
        print(line, flush=True)
    for t in targets:
        print(f"{t}: " + ", ".join(f"{k} {v}" for k, v in counts[t].items()))


if __name__ == "__main__":
    main()
