"""Loading a DeepSeek-V3 fp8 checkpoint onto the GPU: what it holds and what the load
peaks at, kept fp8 (the GPU default) against dequantised (keep_fp8=False), issue 13.

The checkpoint is written here in DeepSeek's layout (e4m3 weights, fp32 scales per
128 x 128 block, experts one tensor each) with V3's real widths: hidden 7168, 128 heads,
q LoRA 1536, KV LoRA 512, dense MLP 18432, expert width 2048; one dense and one MoE
layer, but 16 routed experts (not 256) and a 8192-token vocabulary, so it is ~2 GB.
Weights are random (normal(0, 0.02) quantised per block).

Per mode (kiln.models.deepseek_v3_checkpoint.load_checkpoint, bf16, on the device):
load seconds; the GPU memory held after the load and its peak during it (torch's
allocator, from before the load); the bytes of the fp8 projections, their scales,
the routed experts (bf16 either way: no grouped fp8 MoE kernel yet) and everything
else. Kept fp8, the peak should sit one tensor's dequantisation (the largest expert or
kv_b_proj in fp32, ~67 MB) above what is held, and what is held should be ~1 byte per
projection weight; a dequantised copy of a projection would show as ~2 bytes.
Then eager logits of 8 tokens, kept fp8 against dequantised: fp8 activations only
(a few % at two layers).

Usage (GPU): PYTHONPATH=. python benchmarks/deepseek_fp8_load.py --out $OUT/deepseek_fp8_load.json
Smoke test anywhere: PYTHONPATH=. python benchmarks/deepseek_fp8_load.py --device cpu --small
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kiln.models import deepseek_v3_checkpoint as ds
from kiln.models.deepseek_v3 import DeepseekV3
from kiln.models.fp8 import use_fp8_layout
from kiln.ops import quantize_weight

V3_SLICE = dict(vocab_size=8192, hidden_size=7168, num_attention_heads=128,
                num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=16,
                n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
                first_k_dense_replace=1, num_hidden_layers=2, routed_scaling_factor=2.5,
                max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
                model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]})
SMALL = dict(V3_SLICE, vocab_size=512, hidden_size=256, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, intermediate_size=384,
             moe_intermediate_size=128)


def write_checkpoint(path: Path, config: dict, device: str) -> int:
    """DeepSeek's fp8 layout of `config`, random; the bytes written."""
    cfg = ds.config_from_hf(config)
    with torch.device("meta"):
        model = DeepseekV3(cfg)
    use_fp8_layout(model, config, "benchmark")  # names, shapes, which are fp8
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = {}

    def fp8(name, shape):
        w = torch.randn(shape, generator=gen, device=device) * 0.02
        q, s = quantize_weight(w)
        tensors[name], tensors[name + "_scale_inv"] = q.cpu(), s.cpu()

    for name, t in model.state_dict().items():
        if name.endswith("weight_scale_inv") or name.endswith((".w_uk", ".w_uv")):
            continue
        if ".mlp.experts." in name:  # stacked [E, ...]: one tensor per expert
            prefix, _, proj = name.rpartition(".")
            for e in range(t.shape[0]):
                fp8(f"{prefix}.{e}.{proj}.weight", t.shape[1:])
        elif t.dtype == torch.float8_e4m3fn:
            fp8(name, t.shape)
        elif name.endswith("norm.weight"):
            tensors[name] = torch.ones(t.shape, dtype=torch.bfloat16)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = torch.zeros(t.shape)
        else:
            w = torch.randn(t.shape, generator=gen, device=device) * 0.02
            tensors[name] = w.to(torch.bfloat16).cpu()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return sum(t.nbytes for t in tensors.values())


def held_bytes(model) -> dict:
    """Bytes the loaded model holds, by kind."""
    out = {"fp8_projections": 0, "scales": 0, "routed_experts": 0, "other": 0}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        kind = ("fp8_projections" if t.dtype == torch.float8_e4m3fn else
                "scales" if name.endswith("weight_scale_inv") else
                "routed_experts" if ".mlp.experts." in name else "other")
        out[kind] += t.numel() * t.element_size()
    return out


def load(path: Path, device: str, keep: bool) -> tuple[object, dict]:
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    model, _ = ds.load_checkpoint(path, torch.bfloat16, device, keep_fp8=keep)
    if cuda:
        torch.cuda.synchronize()
    row = {"keep_fp8": keep, "load_s": time.perf_counter() - t0,
           "fp8_linears": sum(type(m).__name__ == "Fp8Linear" for m in model.modules()),
           "held_bytes": held_bytes(model)}
    if cuda:
        row["gpu_held_bytes"] = torch.cuda.memory_allocated() - base
        row["gpu_peak_bytes"] = torch.cuda.max_memory_allocated() - base
        row["peak_over_held_bytes"] = row["gpu_peak_bytes"] - row["gpu_held_bytes"]
    return model, row


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny widths (a smoke test)")
    ap.add_argument("--dir", help="write the checkpoint here (default: a temporary dir)")
    return ap.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    config = SMALL if a.small else V3_SLICE
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(a.dir or tmp) / "dsv3_fp8_slice"
        written = write_checkpoint(path, config, a.device)
        results = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                   "torch": torch.__version__, "config": config,
                   "checkpoint_bytes": written, "rows": []}
        tokens = torch.randint(0, config["vocab_size"], (1, 8), device=a.device,
                               generator=torch.Generator(device=a.device).manual_seed(1))
        logits = {}
        for keep in (True, False):
            model, row = load(path, a.device, keep)
            with torch.no_grad():
                logits[keep] = model(tokens, torch.arange(8, device=a.device)).float().cpu()
            del model
            results["rows"].append(row)
            print(json.dumps(row))
        ref = logits[False].double()
        results["logits_rel_err_kept_vs_dequantised"] = \
            ((logits[True].double() - ref).norm() / ref.norm()).item()
        print("logits rel err, kept fp8 vs dequantised:",
              results["logits_rel_err_kept_vs_dequantised"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return results


if __name__ == "__main__":
    main()
