"""A Qwen3-Next-80B-A3B-shaped slice on the local GPU: prefill 2048 and decode at context
2048 through kiln.models, beside eager PyTorch, against the byte floor (issue 14).

The model: the published config (Qwen/Qwen3-Next-80B-A3B-Instruct's config.json: hidden
2048; 16 heads, 2 KV heads of 256 with a quarter rotary; gated delta rule with 16 key
heads and 32 value heads of 128, conv kernel 4; 512 experts of width 512, top 10, and a
shared expert of 512; vocab 151936; transformers' Qwen3NextConfig defaults agree on every
width) with 4 of its 48 layers, in the real pattern's order: 3 linear_attention, then 1
full_attention, every one a MoE. Random bf16 weights (kiln.models.hf.random_model: the
same rule and seed as every kiln random model), built from the config dict as a
checkpoint's config.json would be (hf.config_from_hf), and compiled by kiln.models.LLM
as `kiln generate` runs it: a prefill module with a dynamic sequence dim, a decode
module whose batch buckets replay as CUDA graphs; the experts in their auto forms
(grouped kernel for the prefill, gathered for decode steps of at most 4 rows).

For each batch size in --batch (its own LLM: a decode module compiled for that many
rows), CUDA events, median:
- prefill: B prompts of --context tokens, logits at each row's last token;
- decode: one token per row at position --context (the context before it: --context
  tokens), the step `generate` takes (LLM.forward, CUDA graph replay), 20 steps queued
  back to back between two events as generate runs them (decode_ahead.py: the host
  prepares a step while the GPU runs the one before); `decode_synced_ms` is one step
  on an idle GPU (the host's ~30-40 us before the graph starts is in it);
- eager: the same model object, uncompiled, on the same inputs.
kiln's logits are checked after a prefill and after one decode step against eager's
(relative error, both bf16) and, at batch 1, against an fp32 copy of the model run
eagerly (eager bf16's error beside it: kiln should be no further from fp32 than eager).

The floor of a decode step is the bytes it must move at the copy bandwidth measured in
the same run (kiln.bench.floors): every weight read once (projections, norms, router,
shared expert, LM head), the chosen experts' weights (min(B * 10, 512) distinct experts
per layer: random routing), the batch's embedding rows, the linear layers' recurrent
state (fp32) and conv state read and written, the full-attention layer's KV cache read
(context + 1 rows) and its new row written, the logits written. Target: kiln's decode
step within 1.3x of it at batch 1. Also reported: the bytes kiln's own plan moves per
step (kiln.dispatch.cost: the floor plus what kiln adds), its kernel launches, and a
prefill matmul floor (2 * tokens * active weights plus causal attention's flops at the
measured bf16 matmul rate; the gated delta rule's chunk work is not counted).

Usage (GPU; a few minutes with --tune none; the fp32 copy needs 27 GB more for a moment):
    PYTHONPATH=. python benchmarks/qwen3_next_slice.py --out $OUT/qwen3_next_slice.json
Smoke test anywhere (tiny widths, CPU target; --target interpret for the Triton kernels):
    PYTHONPATH=. python benchmarks/qwen3_next_slice.py --small
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time

import torch

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (the fields kiln reads)
PUBLISHED = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
    "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "partial_rotary_factor": 0.25, "rope_theta": 10000000,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "intermediate_size": 5120,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "hidden_act": "silu", "attention_bias": False, "dtype": "bfloat16",
}
SMALL = dict(PUBLISHED, vocab_size=512, hidden_size=64, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
             shared_expert_intermediate_size=32)
SLICE = ["linear_attention"] * 3 + ["full_attention"]  # layers 0-3 of the real pattern


def slice_config(small: bool, context: int):
    """(config.json of the slice, kiln's Qwen3NextConfig for it)."""
    from kiln.models.hf import config_from_hf

    hf_cfg = dict(SMALL if small else PUBLISHED, num_hidden_layers=len(SLICE),
                  layer_types=SLICE)
    return hf_cfg, config_from_hf(hf_cfg, "the slice's config", max_seq_len=context + 16)


def decode_floor_bytes(model, B: int, context: int) -> dict[str, int]:
    """What a decode step of B rows at `context` must move, by kind (see the top)."""
    cfg = model.cfg
    parts = dict.fromkeys(("weights", "experts", "embedding rows", "linear state",
                           "kv cache", "logits"), 0)
    chosen = min(B * cfg.experts_per_token, cfg.n_experts)
    for name, p in model.named_parameters():  # a tied embedding once, as the LM head
        if name == "model.embed_tokens.weight" and not cfg.tie_word_embeddings:
            parts["embedding rows"] += B * p[0].numel() * p.element_size()
        elif ".mlp.experts." in name:
            parts["experts"] += chosen * p[0].numel() * p.element_size()
        else:
            parts["weights"] += p.numel() * p.element_size()
    for layer in model.model.layers:
        if layer.layer_type == "linear_attention":
            state = layer.linear_attn.state
            row = state.recurrent[0].nbytes + state.conv[0].nbytes
            parts["linear state"] += 2 * B * row  # read and written
        else:
            cache = layer.self_attn.kv_cache
            row = cache.k_cache[0, 0].nbytes  # one position's keys (values the same)
            parts["kv cache"] += 2 * B * ((context + 1) * row + row)
    parts["logits"] = B * cfg.vocab_size * model.lm_head.weight.element_size()
    return parts


def prefill_flops(model, B: int, T: int) -> int:
    """Matmul flops of a prefill of B x T tokens (logits at one token per row): every
    token through the projections, the shared and its chosen experts; causal attention."""
    cfg = model.cfg
    active = 0
    for name, p in model.named_parameters():
        if name in ("model.embed_tokens.weight", "lm_head.weight") or p.dim() < 2:
            continue
        per_expert = ".mlp.experts." in name
        active += p[0].numel() * cfg.experts_per_token if per_expert else p.numel()
    attn_layers = sum(t == "full_attention" for t in cfg.layer_types)
    attention = 2 * 2 * B * cfg.n_heads * cfg.head_dim * T * (T + 1) // 2 * attn_layers
    return 2 * B * T * active + attention + 2 * B * cfg.vocab_size * cfg.dim


def planned_bytes(module, rows: int) -> int | None:
    """The bytes kiln's plan moves per call (kiln.dispatch.cost), at `rows` rows."""
    from kiln.dispatch.cost import ZERO, plan_costs
    from kiln.ir.symbolic import evaluate

    plan = module.plan
    total = sum(plan_costs(plan).values(), ZERO).bytes
    env = {s: rows for s, name in plan.dim_names.items() if name == "batch"}
    try:
        return int(evaluate(total, env))
    except Exception:  # a size other than the batch left symbolic
        return None


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def profile(fn, iters: int = 10, top: int = 15) -> list[str]:
    """GPU time per call of the kernels `fn` launches, largest first (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for e in p.key_averages():
        t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows[e.key] = (t / iters, e.count // iters)
    total = sum(t for t, _ in rows.values())
    out = [f"{total / 1e3:.3f} ms of kernels per call"]
    for k, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"{t / 1e3:8.4f} ms {100 * t / max(total, 1e-9):5.1f}%  x{n:<4} {k[:80]}")
    return out


def fp32_reference(model, B: int, prompt, ppos, last, tok, dpos):
    """(prefill logits, decode logits) of an fp32 copy of `model`, run eagerly."""
    ref = copy.deepcopy(model).float()
    ref.setup_cache(max_batch_size=B)
    with torch.no_grad():
        out = ref(prompt, ppos, logits_at=last), ref(tok, dpos)
    del ref
    return out


def run_batch(model, B: int, a, floors, device: str, target: str) -> dict:
    """Compile an LLM for B rows, time its prefill and decode (and eager's), check them."""
    from kiln.bench.timing import back_to_back_ms, median_ms
    from kiln.models.generate import LLM

    cfg, T = model.cfg, a.context
    row: dict = {"batch": B, "context": T}
    t0 = time.perf_counter()
    llm = LLM(model, target=target, max_batch_size=B, name="qwen3-next slice",
              compile_options={"tune": a.tune} if a.tune else None)
    row["compile_s"] = llm.compile_s  # both modules' kiln.compile
    row["load_s"] = time.perf_counter() - t0  # and CUDA graph capture, warm-up
    dec = llm.decode_module
    row["decode_kernels"] = len(dec.plan.regions)
    row["decode_planned_bytes"] = planned_bytes(dec, B)
    gen = torch.Generator().manual_seed(B)
    prompt = torch.randint(0, cfg.vocab_size, (B, T), generator=gen).to(device)
    ppos = torch.arange(T, device=device)
    last = torch.full((B, 1), T - 1, device=device)
    tok = torch.randint(0, cfg.vocab_size, (B, 1), generator=gen).to(device)
    dpos = torch.full((B, 1), T, device=device)
    ref = None
    if B == 1 and not a.no_fp32_check:
        ref = fp32_reference(model, B, prompt, ppos, last, tok, dpos)
    with torch.no_grad():
        kiln_pre = llm.forward(prompt, ppos, logits_at=last).clone()
        kiln_dec = llm.forward(tok, dpos).clone()
        if not a.no_eager:  # eager's prefill starts its rows afresh (position 0)
            eager_pre = model(prompt, ppos, logits_at=last)
            eager_dec = model(tok, dpos)
            row["err_prefill_vs_eager"] = rel_err(kiln_pre, eager_pre)
            row["err_decode_vs_eager"] = rel_err(kiln_dec, eager_dec)
            if ref is not None:
                row["eager_err_vs_fp32"] = [rel_err(eager_pre, ref[0]), rel_err(eager_dec, ref[1])]
        if ref is not None:
            row["kiln_err_vs_fp32"] = [rel_err(kiln_pre, ref[0]), rel_err(kiln_dec, ref[1])]

        def prefill():
            return llm.forward(prompt, ppos, logits_at=last)

        def decode():
            return llm.forward(tok, dpos)

        row["prefill_ms"] = median_ms(prefill, device, warmup=2, iters=a.prefill_iters)
        prefill()  # the decode steps below run at context T
        # steps back to back, as generate runs them (decode_ahead.py); each step alone
        # on an idle device also pays the host's work before its graph starts
        row["decode_ms"] = back_to_back_ms(decode, device, reps=max(3, a.decode_iters // 10))
        row["decode_synced_ms"] = median_ms(decode, device, warmup=5, iters=a.decode_iters)
        if not a.no_eager:
            row["eager_prefill_ms"] = median_ms(lambda: model(prompt, ppos, logits_at=last),
                                                device, warmup=1, iters=3)
            row["eager_decode_ms"] = median_ms(lambda: model(tok, dpos), device, warmup=2,
                                               iters=10)
        if a.profile and device == "cuda":
            row["profile_decode"] = profile(decode)
            row["profile_prefill"] = profile(prefill, iters=3)
    floor = decode_floor_bytes(model, B, T)
    row["decode_floor_parts"] = floor
    row["decode_floor_bytes"] = sum(floor.values())
    row["prefill_tokens_per_s"] = B * T / (row["prefill_ms"] * 1e-3)
    row["decode_tokens_per_s"] = B / (row["decode_ms"] * 1e-3)
    if floors is not None:
        row["decode_floor_ms"] = floors.bytes_ms(row["decode_floor_bytes"])
        row["decode_vs_floor"] = row["decode_ms"] / row["decode_floor_ms"]
        row["prefill_matmul_floor_ms"] = floors.flops_ms(prefill_flops(model, B, T))
        if row["decode_planned_bytes"] is not None:
            row["decode_planned_ms_at_copy_bw"] = floors.bytes_ms(row["decode_planned_bytes"])
    return row


def table(results: dict) -> str:
    lines = [f"device: {results['device']}  target: {results['target']}  "
             f"dtype: {results['dtype']}  tune: {results['tune']}  "
             f"copy {results.get('copy_gbs', float('nan')):.0f} GB/s  "
             f"weights {results['weight_bytes'] / 1e9:.2f} GB"]
    for r in results["batches"]:
        B, T = r["batch"], r["context"]
        lines.append(f"-- batch {B}, context {T}: compile {r['compile_s']:.1f} s "
                     f"(load {r['load_s']:.1f} s), decode {r['decode_kernels']} kernels")
        eager = r.get("eager_prefill_ms")
        lines.append(f"   prefill {T:5d} x {B}: kiln {r['prefill_ms']:9.3f} ms"
                     + (f"  eager {eager:9.3f} ms ({eager / r['prefill_ms']:.1f}x)"
                        if eager else "")
                     + (f"  matmul floor {r['prefill_matmul_floor_ms']:.3f} ms"
                        if "prefill_matmul_floor_ms" in r else "")
                     + f"  {r['prefill_tokens_per_s']:.0f} tok/s")
        eager = r.get("eager_decode_ms")
        lines.append(f"   decode step:    kiln {r['decode_ms']:9.4f} ms"
                     + (f"  eager {eager:9.3f} ms ({eager / r['decode_ms']:.1f}x)"
                        if eager else "")
                     + f"  {r['decode_tokens_per_s']:.0f} tok/s (steps back to back; one "
                     f"step alone {r['decode_synced_ms']:.4f} ms)")
        if "decode_floor_ms" in r:
            planned = r.get("decode_planned_bytes")
            lines.append(f"   decode floor {r['decode_floor_ms']:.4f} ms "
                         f"({r['decode_floor_bytes'] / 1e6:.1f} MB): kiln / floor "
                         f"{r['decode_vs_floor']:.2f}x"
                         + (f"; kiln's plan moves {planned / 1e6:.1f} MB "
                            f"({r['decode_planned_ms_at_copy_bw']:.4f} ms at copy bandwidth)"
                            if planned else ""))
        parts = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in r["decode_floor_parts"].items())
        lines.append(f"   floor MB: {parts}")
        if "err_prefill_vs_eager" in r:
            lines.append(f"   kiln vs eager logits: prefill {r['err_prefill_vs_eager']:.2e}, "
                         f"decode {r['err_decode_vs_eager']:.2e}")
        for who in ("kiln", "eager"):
            if f"{who}_err_vs_fp32" in r:
                pre, dec = r[f"{who}_err_vs_fp32"]
                lines.append(f"   {who} bf16 vs fp32 eager: prefill {pre:.2e}, decode {dec:.2e}")
        for key in ("profile_decode", "profile_prefill"):
            if key in r:
                lines.append(f"   {key}:")
                lines += [f"     {x}" for x in r[key]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--small", action="store_true", help="tiny widths on the CPU (smoke)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--target", help="kiln target (default: cuda on a GPU, else cpu)")
    ap.add_argument("--context", type=int, help="prompt tokens (default 2048; 24 small)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tune", default="none", choices=["none", "fast", "full"])
    ap.add_argument("--prefill-iters", type=int, default=10)
    ap.add_argument("--decode-iters", type=int, default=100)
    ap.add_argument("--no-eager", action="store_true", help="skip the eager reference")
    ap.add_argument("--no-fp32-check", action="store_true",
                    help="skip the fp32 copy of the model (batch 1's accuracy reference)")
    ap.add_argument("--profile", action="store_true", help="kernel times of kiln's steps")
    a = ap.parse_args()
    from kiln.bench.floors import measure
    from kiln.models.hf import random_model

    device = a.device or ("cuda" if torch.cuda.is_available() and not a.small else "cpu")
    target = a.target or ("cuda" if device == "cuda" else "cpu")
    a.context = a.context or (24 if a.small else 2048)
    if a.small:
        a.prefill_iters, a.decode_iters = min(a.prefill_iters, 3), min(a.decode_iters, 5)
    dtype = torch.bfloat16
    hf_cfg, cfg = slice_config(a.small, a.context)
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "target": target, "dtype": "bfloat16", "tune": a.tune,
               "torch": torch.__version__, "config": hf_cfg, "batches": []}

    def save():
        if a.out:
            with open(a.out, "w") as f:
                json.dump(results, f, indent=2, default=str)

    floors = measure(device, dtype, small=a.small or device != "cuda")
    results["copy_gbs"] = floors.copy_bytes_per_s / 1e9
    results["matmul_tflops"] = floors.matmul_flops_per_s / 1e12
    model = random_model(cfg, dtype, device, seed=0)
    results["weight_bytes"] = sum(p.nbytes for p in model.parameters())
    save()
    for B in a.batch:
        results["batches"].append(run_batch(model, B, a, floors, device, target))
        save()  # each batch's numbers survive a later failure
        gc.collect()  # the batch's LLM (its CUDA graphs, buffers) before the next one
        if device == "cuda":
            torch.cuda.empty_cache()
    print(table(results))


if __name__ == "__main__":
    main()
