"""A DeepSeek-V3-shaped slice on the local GPU, fp8 as DeepSeek ships it: kiln against
transformers' own DeepseekV3 modules and against the byte and flops floors (issue 13).

The model: transformers' DeepseekV3Config defaults (V3's widths: hidden 7168; 128
heads; q LoRA 1536, KV LoRA 512 + a 64-wide rope part, nope 128, value 128; 256 routed
experts of width 2048, top 8 of n_group 8 / topk_group 4, one shared expert; vocab
129280) with V3's YaRN (factor 40 over 4096) and 4 of its 61 layers: one dense (MLP
18432) and three MoE. Random weights written as DeepSeek's release stores them
(kiln's checkpoint reader takes nothing else): every projection, routed experts one
tensor each, in e4m3 with fp32 `weight_scale_inv` per 128 x 128 block; router,
norms, embedding, LM head in bf16; the score-correction bias fp32 and non-zero. The
checkpoint is sharded (one shard per layer, with model.safetensors.index.json) in a
temporary directory (/dev/shm when it has room), and kiln reads it the way a user's
checkpoint is read: kiln.models.load(dir, keep_fp8=True), so the projections stay
fp8 (its routed experts are dequantised into bf16 until the grouped fp8 MoE lands:
the JSON says which dtype they had).

The reference: transformers.DeepseekV3ForCausalLM built from the same config.json, in
bf16, its weights the checkpoint's dequantised (weight * block scale), SDPA attention,
eager, DynamicCache holding the latents. It runs first and is freed before kiln loads
(the two would not fit one H100 together: 67 GB of bf16 experts each). Per batch B
(--batch) and each case, both on the same tokens:
- prefill T (--prefill): B prompts of T tokens, logits at the last one;
- decode at context C (--contexts): a prefill of C tokens, then one token per row at
  position C: kiln's decode module (its CUDA graph for B rows; 20 steps queued back to
  back between two events, as generate runs them: decode_ahead.py; `kiln_synced_ms`
  is one step on an idle GPU, the host's work before its graph included),
  transformers' step with the cache cropped back after each timed call.
kiln's logits are compared with transformers' (relative error: kiln's fp8 activations
and fp8 projections against bf16 dequantised weights, so fp8's own error: a random
router turns small differences into other experts; at --small widths kiln loaded with
keep_fp8=False is 6e-3 from transformers, kept fp8 2e-1) and with kiln's own model
run eagerly on the same inputs (the compile's error alone: bf16, ~1e-2). A case the
reference runs out of memory for is marked so and kiln still runs it.

Floors (kiln.bench.floors: copy bandwidth and a bf16 matmul's rate measured in this
run; torch._scaled_mm's fp8 rate beside them on a GPU):
- decode: the bytes a step must read at the checkpoint's own dtypes: every fp8
  projection once (attention's, with kv_b_proj as fp8 whatever form reads it; the
  dense MLP; the shared experts) and their scales, the routed experts the step's
  tokens actually chose (distinct experts per layer, from transformers' router on
  these inputs; min(B * 8, 256) without the reference), router, norms, the batch's
  embedding rows, the bf16 LM head, the latent cache (C + 1 rows of 576 per layer
  read, one written), the logits written. `floor at kiln's dtypes` counts what kiln
  holds instead (bf16 routed experts, bf16 W_UK / W_UV for the absorbed decode):
  the part of kiln / floor that is a missing kernel, not a slow one.
- prefill: 2 * tokens * active weights (projections, router, 8 routed + 1 shared
  expert) plus causal attention (QK 192 wide, PV 128) plus the LM head at one token,
  at the bf16 matmul rate and at the fp8 rate.

Usage (GPU, one H100; ~39 GB of checkpoint in /dev/shm or $TMPDIR; a few minutes):
    PYTHONPATH=. python benchmarks/deepseek_v3_slice.py --out $OUT/deepseek_v3_slice.json
--keep-checkpoint DIR writes the checkpoint there once and reuses it on later runs.
Smoke test anywhere (tiny widths, CPU target):
    PYTHONPATH=. python benchmarks/deepseek_v3_slice.py --small
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import rel_err  # noqa: E402

# DeepSeek-V3's config.json where transformers' DeepseekV3Config defaults differ
V3 = {"num_hidden_layers": 4, "first_k_dense_replace": 1, "max_position_embeddings": 163840,
      "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                          "original_max_position_embeddings": 4096, "mscale": 1.0,
                          "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
      "eos_token_id": None, "bos_token_id": None}
SMALL = dict(V3, vocab_size=512, hidden_size=256, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, intermediate_size=384,
             moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4,
             n_group=4, topk_group=2)
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [128, 128]}
INDEX = "model.safetensors.index.json"


def hf_config(small: bool) -> dict:
    """config.json of the slice: transformers' DeepseekV3Config, plus DeepSeek's fp8
    quantization_config."""
    import transformers

    cfg = transformers.DeepseekV3Config(**(SMALL if small else V3)).to_dict()
    cfg.update(architectures=["DeepseekV3ForCausalLM"], quantization_config=FP8,
               dtype="bfloat16")
    return cfg


# ---- the checkpoint -------------------------------------------------------------------


def _hf_model(hf_cfg: dict, device):
    import transformers

    cfg = transformers.DeepseekV3Config(**{k: v for k, v in hf_cfg.items()
                                           if k != "quantization_config"})
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        return transformers.DeepseekV3ForCausalLM(cfg), cfg


def stored_tensors(hf_cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor DeepSeek's release stores: name -> (shape, kind), kind "fp8" (with a
    _scale_inv beside it), "norm", "bias" (fp32) or "bf16"; experts one by one."""
    model, _ = _hf_model(hf_cfg, "meta")
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix, (E, I2, D) = name.removesuffix("gate_up_proj"), t.shape
            for e in range(E):
                out[f"{prefix}{e}.gate_proj.weight"] = ((I2 // 2, D), "fp8")
                out[f"{prefix}{e}.up_proj.weight"] = ((I2 // 2, D), "fp8")
                out[f"{prefix}{e}.down_proj.weight"] = (tuple(model.get_parameter(
                    prefix + "down_proj").shape[1:]), "fp8")
        elif name.endswith("experts.down_proj"):
            continue
        elif name.endswith("e_score_correction_bias"):
            out[name] = (tuple(t.shape), "bias")
        elif "norm" in name:
            out[name] = (tuple(t.shape), "norm")
        elif name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
            out[name] = (tuple(t.shape), "fp8")
        else:  # embedding, LM head, router
            out[name] = (tuple(t.shape), "bf16")
    return out


def _random(name: str, shape, kind: str, device) -> dict[str, torch.Tensor]:
    """One stored tensor (and its scales), seeded by its name: the same on every run."""
    from kiln.ops import quantize_weight

    gen = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
    x = torch.randn(shape, generator=gen, device=device)
    if kind == "fp8":
        q, s = quantize_weight(x * 0.02)
        return {name: q, name.removesuffix("weight") + "weight_scale_inv": s}
    if kind == "norm":
        return {name: (1 + 0.1 * x).bfloat16()}
    if kind == "bias":
        return {name: 0.05 * x}
    return {name: (0.02 * x).bfloat16()}


def write_checkpoint(path: Path, hf_cfg: dict, device) -> int:
    """The slice's random fp8 checkpoint in DeepSeek's layout under `path`: one shard
    per layer and one for the rest, with the index. Returns the bytes written."""
    path.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    specs = stored_tensors(hf_cfg)
    shards: dict[str, list[str]] = {}
    for name in specs:
        parts = name.split(".")
        key = f"layer{int(parts[2]):03d}" if parts[:2] == ["model", "layers"] else "rest"
        shards.setdefault(key, []).append(name)
    weight_map, total = {}, 0
    for i, (_, names) in enumerate(sorted(shards.items())):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            for n, t in _random(name, *specs[name], device).items():
                tensors[n] = t.cpu()
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                          "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=1))
    return total


def checkpoint_dir(a, hf_cfg: dict) -> tuple[Path, bool, float]:
    """(directory, whether to delete it after, seconds spent writing)."""
    if a.keep_checkpoint:
        path = Path(a.keep_checkpoint)
        if (path / "config.json").is_file() and (path / INDEX).is_file() and \
                json.loads((path / "config.json").read_text()) == hf_cfg:
            return path, False, 0.0
        shutil.rmtree(path, ignore_errors=True)
    else:
        need = 42e9 if not a.small else 1e8  # the slice's fp8 checkpoint (38.8 GB), with room
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and shutil.disk_usage(shm).free > need else None
        path = Path(tempfile.mkdtemp(prefix="dsv3-slice-", dir=base))
    t0 = time.perf_counter()
    write_checkpoint(path, hf_cfg, a.device)
    return path, not a.keep_checkpoint, time.perf_counter() - t0


# ---- transformers' model, dequantised ------------------------------------------------


def reference_model(path: Path, hf_cfg: dict, device):
    """transformers.DeepseekV3ForCausalLM in bf16 holding the checkpoint's weights
    dequantised (the routed experts stacked as it stacks them: gate and up in one)."""
    from safetensors import safe_open

    from kiln.ops import dequantize_weight

    model, cfg = _hf_model(hf_cfg, "meta")
    model = model.to(torch.bfloat16).to_empty(device=device)
    index = json.loads((path / INDEX).read_text())["weight_map"]
    handles = {}

    def read(name: str) -> torch.Tensor:
        f = index[name]
        if f not in handles:
            handles[f] = safe_open(str(path / f), framework="pt", device=str(device))
        t = handles[f].get_tensor(name)
        scale = name.removesuffix("weight") + "weight_scale_inv"
        if scale in index:
            t = dequantize_weight(t, read(scale))
        return t

    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name.endswith("experts.gate_up_proj"):
                prefix, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
                for e in range(t.shape[0]):
                    t[e, :inter] = read(f"{prefix}{e}.gate_proj.weight")
                    t[e, inter:] = read(f"{prefix}{e}.up_proj.weight")
            elif name.endswith("experts.down_proj"):
                prefix = name.removesuffix("down_proj")
                for e in range(t.shape[0]):
                    t[e] = read(f"{prefix}{e}.down_proj.weight")
            elif name.endswith("e_score_correction_bias"):  # fp32, as transformers holds it
                owner, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(owner), leaf, read(name).float())
            elif name in index:
                t.copy_(read(name))
        # RoPE's inverse frequencies are computed, not stored: make them on the device
        rotary = type(model.model.rotary_emb)
        with torch.device(device):
            model.model.rotary_emb = rotary(cfg)
    return model.eval()


class Routing:
    """The experts transformers' routers choose during a call: distinct per MoE layer."""

    def __init__(self, model):
        self.chosen: list[torch.Tensor] = []
        self.hooks = [m.register_forward_hook(self._record) for m in model.modules()
                      if type(m).__name__ == "DeepseekV3TopkRouter"]

    def _record(self, module, args, out):
        self.chosen.append(out[2])

    def distinct(self) -> list[int]:
        out = [int(ids.unique().numel()) for ids in self.chosen]
        for h in self.hooks:
            h.remove()
        return out


def run_reference(model, cases: list[dict], a) -> None:
    """transformers' logits, times and decode routing for each case (added to it)."""
    with torch.no_grad():
        for c in cases:
            run = _reference_prefill if c["phase"] == "prefill" else _reference_decode
            try:
                run(model, c, a)
            except torch.OutOfMemoryError:  # the reference's, not kiln's: say so, go on
                c["hf_error"] = "out of memory"
                gc.collect()
                torch.cuda.empty_cache()


def _cache_arg(model) -> str:
    """The cache keyword of this transformers' forward (`cache` from 5.2x on,
    `past_key_values` before: an unknown keyword is silently taken as a kwarg)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"


def _reference_prefill(model, c: dict, a) -> None:
    from transformers import DynamicCache

    from kiln.bench.timing import median_ms

    def step():
        kw = {_cache_arg(model): DynamicCache(config=model.config)}
        return model(c["tokens"], use_cache=True, logits_to_keep=1, **kw).logits[:, -1]

    c["ref"] = step().float()
    c["hf_ms"] = median_ms(step, a.device, warmup=1, iters=a.hf_iters)


def _reference_decode(model, c: dict, a) -> None:
    """A prefill of the context, then the step at position C, timed with the cache
    cropped back to C after each call."""
    from transformers import DynamicCache

    from kiln.bench.timing import median_ms

    cache = DynamicCache(config=model.config)
    kw = {_cache_arg(model): cache}
    model(c["tokens"], use_cache=True, logits_to_keep=1, **kw)
    pos = torch.full_like(c["next"], c["tokens"].shape[1])

    def step():
        out = model(c["next"], position_ids=pos, use_cache=True, **kw)
        cache.crop(-1)  # back to C tokens
        return out.logits[:, -1]

    routing = Routing(model)
    try:
        ref = step().float()
    finally:
        chosen = routing.distinct()  # the hooks go either way
    c["ref"], c["chosen_experts"] = ref, chosen
    c["hf_ms"] = median_ms(step, a.device, warmup=2, iters=3 * a.hf_iters)


# ---- kiln -----------------------------------------------------------------------------


def run_kiln(llm, cases: list[dict], a) -> None:
    """kiln's logits and times for each case of llm's batch (added to it); its logits
    against its own model run eagerly (the same fp8 weights: only the compile differs)."""
    with torch.no_grad():
        for c in cases:
            _kiln_case(llm, c, a)


def _kiln_case(llm, c: dict, a) -> None:
    from kiln.bench.timing import back_to_back_ms, median_ms

    toks = c["tokens"]
    B, T = toks.shape
    last = torch.full((B, 1), T - 1, device=toks.device)
    pos = torch.arange(T, device=toks.device)

    def prefill():
        return llm.forward(toks, pos, logits_at=last)

    if c["phase"] == "prefill":
        c["out"] = prefill()[:, -1].float()
        _eager_check(c, lambda: llm.model(toks, pos, logits_at=last))
        c["kiln_ms"] = median_ms(prefill, a.device, warmup=2, iters=a.prefill_iters)
        return
    prefill()
    at = torch.full_like(c["next"], T)

    def decode():
        return llm.forward(c["next"], at)

    c["out"] = decode()[:, -1].float()
    _eager_check(c, lambda: llm.model(c["next"], at))
    # steps back to back, as generate runs them (decode_ahead.py); each step alone on an
    # idle device also pays the host's work before its graph starts
    c["kiln_ms"] = back_to_back_ms(decode, a.device, reps=max(3, a.decode_iters // 10))
    c["kiln_synced_ms"] = median_ms(decode, a.device, warmup=5, iters=a.decode_iters)


def _eager_check(c: dict, eager) -> None:
    """kiln's logits against its model run eagerly; None if eager (kiln.ops' PyTorch
    forms: the fp8 linear dequantises its weight in fp32) runs out of memory beside
    kiln's own buffers."""
    try:
        c["err_vs_eager"] = rel_err(c["out"], eager()[:, -1])
    except torch.OutOfMemoryError:
        c["err_vs_eager"] = None
        gc.collect()
        torch.cuda.empty_cache()


# ---- floors ---------------------------------------------------------------------------


def decode_floor_bytes(model, B: int, C: int, chosen: list[int], kiln_dtypes: bool
                       ) -> dict[str, int]:
    """What a decode step of B rows at context C must read (see the top), by kind; the
    routed experts at 1 byte a weight (the checkpoint's), or at kiln's dtypes."""
    cfg = model.cfg
    parts = dict.fromkeys(("projections", "routed experts", "other weights",
                           "embedding rows", "latent cache", "logits"), 0)
    moe_layers = sorted({int(n.split(".")[2]) for n, _ in model.named_parameters()
                         if ".mlp.experts." in n})
    for name, p in model.named_parameters():
        if name == "model.embed_tokens.weight":
            parts["embedding rows"] += B * p[0].numel() * p.element_size()
        elif ".mlp.experts." in name:
            # the checkpoint's experts are e4m3 with fp32 block scales
            per = 4 if name.endswith("scale_inv") else 1
            per = p.element_size() if kiln_dtypes else per
            moe = moe_layers.index(int(name.split(".")[2]))
            n = chosen[moe] if chosen else min(B * cfg.n_experts_per_tok, cfg.n_routed_experts)
            parts["routed experts"] += n * p[0].numel() * per
        elif ".kv_b_proj." in name and kiln_dtypes:
            continue  # the absorbed decode reads W_UK / W_UV instead (below)
        elif p.dtype == torch.float8_e4m3fn or name.endswith("weight_scale_inv"):
            parts["projections"] += p.numel() * p.element_size()
        else:
            parts["other weights"] += p.numel() * p.element_size()
    for layer in model.model.layers:
        attn = layer.self_attn
        if kiln_dtypes:
            parts["projections"] += attn.w_uk.nbytes + attn.w_uv.nbytes
        row = cfg.latent_dim * model.lm_head.weight.element_size()
        parts["latent cache"] += B * (C + 2) * row  # C + 1 read, one written
    parts["logits"] = B * cfg.vocab_size * model.lm_head.weight.element_size()
    return parts


def prefill_flops(model, B: int, T: int) -> int:
    """Matmul flops of a prefill of B x T tokens, logits at the last (see the top)."""
    cfg = model.cfg
    active = 0
    for name, p in model.named_parameters():
        if name in ("model.embed_tokens.weight", "lm_head.weight") or p.dim() < 2 \
                or name.endswith("weight_scale_inv"):
            continue
        active += p[0].numel() * cfg.n_experts_per_tok if ".mlp.experts." in name \
            else p.numel()
    per_pair = cfg.qk_head_dim + cfg.v_head_dim  # QK^T, then PV
    attention = 2 * B * cfg.n_heads * per_pair * T * (T + 1) // 2 * cfg.n_layers
    return 2 * B * T * active + attention + 2 * B * cfg.vocab_size * cfg.dim


def fp8_matmul_rate(device: str) -> float | None:
    """Flops per second of torch._scaled_mm on 8192^3 e4m3 (None off CUDA)."""
    if device != "cuda":
        return None
    from kiln.bench.timing import median_ms

    n = 8192
    x = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    w = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    ms = median_ms(lambda: torch._scaled_mm(x, w.t(), one, one, out_dtype=torch.bfloat16),
                   device, warmup=5, iters=20)
    return 2 * n ** 3 / (ms * 1e-3)


def add_floors(row: dict, model, floors, fp8_rate) -> None:
    B, n = row["batch"], row["tokens"]
    if row["phase"] == "decode":
        for key, kiln_dtypes in (("floor", False), ("floor_kiln_dtypes", True)):
            parts = decode_floor_bytes(model, B, n, row.get("chosen_experts"), kiln_dtypes)
            row[f"{key}_parts"] = parts
            row[f"{key}_ms"] = floors.bytes_ms(sum(parts.values()))
    else:
        flops = prefill_flops(model, B, n)
        row["flops"] = flops
        row["floor_ms"] = floors.flops_ms(flops)  # at the bf16 rate
        if fp8_rate:
            row["floor_fp8_ms"] = flops / fp8_rate * 1e3


# ---- the run --------------------------------------------------------------------------


def make_cases(hf_cfg: dict, B: int, a) -> list[dict]:
    gen = torch.Generator().manual_seed(B)
    longest = max((*a.prefill, *a.contexts))
    prompt = torch.randint(0, hf_cfg["vocab_size"], (B, longest), generator=gen)
    nxt = torch.randint(0, hf_cfg["vocab_size"], (B, 1), generator=gen)
    cases = [{"phase": "prefill", "batch": B, "tokens": prompt[:, :T].to(a.device)}
             for T in a.prefill]
    cases += [{"phase": "decode", "batch": B, "tokens": prompt[:, :C].to(a.device),
               "next": nxt.to(a.device)} for C in a.contexts]
    return cases


def kiln_llms(path: Path, a, max_seq_len: int):
    """One kiln LLM per batch size, in turn: the first from the checkpoint directory
    (kiln.models.load, fp8 projections kept), the others recompiled on its model."""
    import kiln.models
    from kiln.models.generate import LLM

    t0 = time.perf_counter()
    llm = kiln.models.load(path, target=a.target, max_seq_len=max_seq_len,
                           max_batch_size=a.batch[0], keep_fp8=True)
    yield llm, time.perf_counter() - t0
    model = llm.model
    for B in a.batch[1:]:
        del llm
        gc.collect()
        if a.device == "cuda":
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        llm = LLM(model, target=a.target, max_batch_size=B, name="deepseek-v3 slice")
        yield llm, time.perf_counter() - t0


def table(r: dict) -> str:
    f = r["floors"]
    lines = [f"DeepSeek-V3 slice (4 layers: 1 dense + 3 MoE, fp8 checkpoint) on {r['device']}, "
             f"target {r['target']}, tune {r['tune']}; copy {f['copy_GBps']:.0f} GB/s, bf16 "
             f"matmul {f['matmul_TFLOPs']:.0f} TFLOP/s"
             + (f", fp8 {f['fp8_matmul_TFLOPs']:.0f}" if f.get("fp8_matmul_TFLOPs") else ""),
             f"checkpoint {r['checkpoint_bytes'] / 1e9:.2f} GB (written in "
             f"{r['write_s']:.0f} s); kiln's routed experts held as {r['kiln_expert_dtype']}",
             "",
             "| row | floor ms | transformers ms | kiln ms | kiln/floor | kiln/transformers "
             "| floor at kiln's dtypes ms | err vs transformers | err vs kiln eager |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        kiln, hf, floor = row.get("kiln_ms"), row.get("hf_ms"), row.get("floor_ms")
        floor_txt = f"{floor:.3f}" if floor else "-"
        if row.get("floor_fp8_ms"):
            floor_txt += f" (fp8 {row['floor_fp8_ms']:.3f})"
        lines.append(
            f"| {row['key']} | {floor_txt} | {_f(hf)} | {_f(kiln)} | "
            f"{_f(kiln / floor if kiln and floor else None, '.2f')} | "
            f"{_f(kiln / hf if kiln and hf else None, '.2f')} | "
            f"{_f(row.get('floor_kiln_dtypes_ms'))} | {_f(row.get('rel_err'), '.1e')} | "
            f"{_f(row.get('err_vs_eager'), '.1e')} |")
    synced = [f"{row['key']} {row['kiln_synced_ms']:.3f}" for row in r["rows"]
              if row.get("kiln_synced_ms")]
    if synced:
        lines.append("kiln decode ms above: steps back to back, as generate runs them; one "
                     "step alone, from an idle device: " + ", ".join(synced))
    for row in r["rows"]:
        if "floor_parts" in row:
            parts = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in row["floor_parts"].items())
            lines.append(f"{row['key']} floor MB: {parts}; experts chosen per MoE layer "
                         f"{row.get('chosen_experts') or 'estimated'}")
    lines.append("kiln load / compile s: " + ", ".join(
        f"b{b} {s:.1f}" for b, s in r["kiln_load_s"].items()))
    return "\n".join(lines)


def _f(v, fmt: str = ".3f") -> str:
    return "-" if v is None else f"{v:{fmt}}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--small", action="store_true", help="tiny widths on the CPU (smoke)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--target", help="kiln target (default: cuda on a GPU, else cpu)")
    ap.add_argument("--batch", type=int, nargs="+", help="batch sizes (1 8; small 1 2)")
    ap.add_argument("--prefill", type=int, nargs="*", help="prompt lengths (128 2048)")
    ap.add_argument("--contexts", type=int, nargs="*", help="decode contexts (128 2048)")
    ap.add_argument("--tune", default="none", choices=["none", "fast", "full"])
    ap.add_argument("--prefill-iters", type=int, default=10)
    ap.add_argument("--decode-iters", type=int, default=100)
    ap.add_argument("--hf-iters", type=int, default=3, help="transformers' timed calls")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' reference")
    ap.add_argument("--keep-checkpoint", metavar="DIR",
                    help="write the checkpoint here (kept; reused when it matches)")
    a = ap.parse_args()
    a.device = a.device or ("cuda" if torch.cuda.is_available() and not a.small else "cpu")
    a.target = a.target or ("cuda" if a.device == "cuda" else "cpu")
    a.batch = a.batch or ([1, 2] if a.small else [1, 8])
    if a.prefill is None:
        a.prefill = [12] if a.small else [128, 2048]
    if a.contexts is None:
        a.contexts = [12] if a.small else [128, 2048]
    if a.small:
        a.prefill_iters, a.decode_iters = min(a.prefill_iters, 2), min(a.decode_iters, 3)
        a.hf_iters = 1
    os.environ["KILN_TUNE"] = a.tune  # kiln.models.load compiles with the default mode
    from kiln.bench.floors import measure

    hf_cfg = hf_config(a.small)
    floors = measure(a.device, torch.bfloat16, small=a.small or a.device != "cuda")
    fp8_rate = fp8_matmul_rate(a.device)
    results = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
               "target": a.target, "tune": a.tune, "torch": torch.__version__,
               "config": hf_cfg, "rows": [], "kiln_load_s": {},
               "floors": {"copy_GBps": floors.copy_bytes_per_s / 1e9,
                          "matmul_TFLOPs": floors.matmul_flops_per_s / 1e12,
                          "fp8_matmul_TFLOPs": fp8_rate / 1e12 if fp8_rate else None}}

    def save():
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=1, default=str) + "\n")

    path, temporary, results["write_s"] = checkpoint_dir(a, hf_cfg)
    results["checkpoint_bytes"] = json.loads((path / INDEX).read_text())["metadata"][
        "total_size"]
    try:
        cases = {B: make_cases(hf_cfg, B, a) for B in a.batch}
        if not a.no_hf:
            t0 = time.perf_counter()
            ref = reference_model(path, hf_cfg, a.device)
            results["hf_load_s"] = time.perf_counter() - t0
            for B in a.batch:
                run_reference(ref, cases[B], a)
            del ref
            gc.collect()
            if a.device == "cuda":
                torch.cuda.empty_cache()
        max_seq_len = max((*a.prefill, *a.contexts)) + 16
        for B, (llm, load_s) in zip(a.batch, kiln_llms(path, a, max_seq_len)):
            results["kiln_load_s"][B] = load_s
            results["kiln_expert_dtype"] = str(
                llm.model.model.layers[-1].mlp.experts.gate_proj.dtype).removeprefix("torch.")
            run_kiln(llm, cases[B], a)
            for c in cases[B]:
                n = c["tokens"].shape[1]
                row = {"key": f"{c['phase']} {n} b{B}", "phase": c["phase"], "batch": B,
                       "tokens": n, "kiln_ms": c["kiln_ms"], "hf_ms": c.get("hf_ms"),
                       "kiln_synced_ms": c.get("kiln_synced_ms"),
                       "err_vs_eager": c["err_vs_eager"],
                       "chosen_experts": c.get("chosen_experts")}
                if "ref" in c:
                    row["rel_err"] = rel_err(c["out"], c["ref"])
                if "hf_error" in c:
                    row["hf_error"] = c["hf_error"]
                add_floors(row, llm.model, floors, fp8_rate)
                results["rows"].append(row)
            save()
            del llm  # its graphs and buffers go before the next batch's compile
    finally:
        if temporary:
            shutil.rmtree(path, ignore_errors=True)
    save()
    print(table(results))


if __name__ == "__main__":
    main()
