"""Models people bring, on a GPU: every architecture the CPU and interpret sweeps ran
(tests/fuzz/FINDINGS.md), tiny and random, compiled by `kiln.compile` as written for a
GPU target, against eager PyTorch on the same GPU.

Why: the sweeps ran the CPU target (regions as torch ops) and the interpret target
(kiln's Triton kernels on Triton's CPU interpreter). Neither builds a kernel for a real
GPU: shared-memory and register limits, the backend compiler's own code and bf16
arithmetic on the device show only there. A row that fails here:
benchmarks/probes/region_bisect.py names the region.

Four sets, each a row per architecture:
- `forward`: the third sweep's architectures (ARCHITECTURES), one forward over
  [2, 9] ids (`--tokens`) with `use_cache=False`, fresh ids at the call;
- `recipe`: zoo_interpret's families through transformers' static-cache export recipe,
  a prompt module (dynamic length) and a one-token module writing the recipe's cache
  on the device; a prefill and two decode steps;
- `models`: zoo_models.py's vision, audio, seq2seq, encoder and multimodal models, one
  forward on fresh inputs;
- `llms`: the seventh sweep's decoder LLMs (LLMS: Qwen3.5, Gemma 4, Llama 4, DeepSeek
  V3.2 / V4, Kimi Linear, Nemotron-H...), as `forward`; a row whose class the installed
  transformers lacks says "absent".
A row whose eager model fails on the device (transformers' recipe for Falcon everywhere,
for BLOOM on a GPU) says so and is not counted as kiln's; so does a mismatch where kiln
matches torch.export's own module and that module differs from eager ("traced differs":
the model runs another program when traced, e.g. Doge under transformers 5.17).
fp32 rows pass under 1e-5; other dtypes under 1e-2, or within twice eager's own error
against an fp32 eager run (+1e-2), as zoo_interpret.py.

    PYTHONPATH=. python benchmarks/zoo_gpu.py [--sets forward,recipe] [--dtype bfloat16]
        [--only Olmo3,llama] [--jobs 4] [--target cuda] [--json F]

`--jobs N` runs N processes, each a share of the rows (the GPU is shared; compiles run
on the host's cores). `--target cpu` runs the same rows on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import warnings

import torch

import kiln
from kiln.errors import KilnWarning

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zoo_interpret as zi  # noqa: E402  (benchmarks/ is not a package)
import zoo_models  # noqa: E402

# the third sweep's architectures: config kwargs over BASE (transformers class prefix)
BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        "n_layer": 2, "n_head": 4, "head_dim": 16, "max_position_embeddings": 128}
MOE = {"num_experts": 4, "num_experts_per_tok": 2}
DEEPSEEK_MOE = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
ARCHITECTURES = {
    "Olmo2": {}, "Olmo3": {}, "Cohere": {}, "Cohere2": {"sliding_window": 4},
    "StableLm": {}, "Starcoder2": {}, "Granite": {},
    "GraniteMoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "Phi": {}, "Gemma": {}, "Glm": {"pad_token_id": 0}, "Glm4": {"pad_token_id": 0},
    "Exaone4": {"sliding_window": 4},
    "SmolLM3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "Ernie4_5": {}, "Ernie4_5_Moe": {"moe_num_experts": 4, "moe_k": 2,
                                     "moe_intermediate_size": 32},
    "HunYuanDenseV1": {}, "Arcee": {}, "Dots1": {**DEEPSEEK_MOE, "n_shared_experts": 1},
    "SeedOss": {}, "Apertus": {}, "Qwen3Moe": {**MOE, "moe_intermediate_size": 32},
    "Mamba": {"state_size": 8, "expand": 2},
    "Mamba2": {"num_heads": 8, "head_dim": 16, "state_size": 8, "n_groups": 1, "expand": 2},
    "FalconH1": {}, "Jamba": MOE, "BitNet": {},
    "MiniMax": {"num_local_experts": 4, "num_experts_per_tok": 2}, "Bamba": {},
    "GraniteMoeHybrid": {}, "Doge": {}, "Nemotron": {},
    "OPT": {"ffn_dim": 128, "word_embed_proj_dim": 64},
    "GPTJ": {"n_embd": 64, "rotary_dim": 8}, "GPTBigCode": {"n_embd": 64},
    "CodeGen": {"n_embd": 64, "rotary_dim": 8}, "Olmoe": MOE, "Helium": {},
    "Glm4Moe": DEEPSEEK_MOE,
    "Lfm2Moe": {**MOE, "moe_intermediate_size": 32, "layer_types": ["conv", "full_attention"],
                "num_dense_layers": 1},
    "FlexOlmo": {**MOE, "pad_token_id": 0, "eos_token_id": 1},
    "Ministral": {"sliding_window": 4},
}

# the seventh sweep's causal LMs (transformers 5.17-5.24): config kwargs over LLM_BASE,
# which gives MoE and latent attention sizes a tiny model holds; the config class is the
# model class's own (Gemma3n's is Gemma3nTextConfig)
LLM_BASE = {**{k: v for k, v in BASE.items() if k not in ("n_layer", "n_head")},
            "moe_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2}
MLA = {"kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
       "v_head_dim": 16, "n_group": 1, "topk_group": 1, "num_key_value_heads": 4}
LLMS = {
    "Qwen3_5": {}, "Qwen3_5Moe": {}, "Gemma4": {}, "Llama4": {}, "Ministral3": {},
    "Mistral4": {**MLA, "first_k_dense_replace": 1, "n_shared_experts": 1},
    "DeepseekV32": MLA, "DeepseekV4": {}, "Glm4MoeLite": {**MLA, "qk_nope_head_dim": 16,
                                                          "n_shared_experts": 1},
    "GlmMoeDsa": MLA, "Youtu": {**MLA, "head_dim": 8}, "AXK1": {**MLA, "head_dim": 8},
    "AXK2": {**MLA, "head_dim": 8},
    "Dots3Note": {**MLA, "head_dim": 32, "index_head_dim": 16, "index_n_heads": 2},
    "MiniMaxM2": {}, "Cohere2Moe": {}, "Phimoe": {}, "ExaoneMoe": {}, "Afmoe": {},
    "HunYuanMoEV1": {}, "GraniteMoeShared": {}, "GraniteSWA": {}, "GraniteMoeSWA": {},
    "MiMoV2Flash": {}, "Lfm3": {}, "HYV3": {}, "HYV4": {}, "Jais2": {}, "SolarOpen": {},
    "Apertus1p5Text": {}, "AriaText": {}, "Cwm": {}, "Zaya": {"num_experts_per_tok": 1},
    "Mellum": {}, "Flint": {}, "Dory": {}, "HyperCLOVAX": {}, "Inkling": {}, "Inkling2": {},
    "Inkling2Loop": {}, "Kolibri1": {}, "Laguna": {}, "Beam": {}, "HrmText": {},
    "Gemma4Unified": {}, "Mllama": {}, "Fuyu": {}, "ModernBertDecoder": {}, "Moshi": {},
    "Emu3": {}, "FalconMamba": {}, "NemotronH": {}, "KimiLinear": {}, "OlmoHybrid": {},
    "BailingHybrid": {}, "LaraMini": {}, "Qwen4Exp": {}, "xLSTM": {}, "Phi4Multimodal": {},
    # causal-LM heads of encoder and seq2seq families
    "BigBirdPegasus": {}, "BlenderbotSmall": {}, "Mvp": {}, "TrOCR": {}, "MegatronBert": {},
    "RemBert": {}, "RoCBert": {}, "RobertaPreLayerNorm": {}, "XLMRobertaXL": {},
    "Camembert": {}, "Data2VecText": {}, "CpmAnt": {}, "GPTNeoXJapanese": {},
    "CsmDepthDecoder": {},
    "Gemma3n": {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                "sliding_window": 4, "num_kv_shared_layers": 2, "vocab_size_per_layer_input": 100,
                "hidden_size_per_layer_input": 8, "laurel_rank": 8,
                "activation_sparsity_pattern": [0.0] * 4, "intermediate_size": [128] * 4},
}


# rows whose ForCausalLM names the wrong config class in some transformers release
# (5.17's CsmDepthDecoderForCausalLM names the composite CsmConfig)
CONFIG_CLASS = {"CsmDepthDecoder": "CsmDepthDecoderConfig"}


class Absent(Exception):
    """The installed transformers has no such model (the GPU image's is older)."""


def rel(a, b) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm()).item()


class EagerFails(Exception):
    """The eager model itself fails (transformers' recipe on this device)."""


def verdict(err: float, err32: float | None, eager32: float | None, tol: float) -> str:
    text = f"{err:.1e}"
    ok = err < tol
    if err32 is not None:  # low precision: kiln against fp32 beside eager's own
        text += f" (fp32 ref {err32:.1e}, eager {eager32:.1e})"
        ok = ok or err32 < 2 * eager32 + tol
    return ("ok " if ok else "MISMATCH ") + text


def forward_model(name: str, dtype, device):
    import transformers

    if name in LLMS:
        cls = getattr(transformers, name + "ForCausalLM", None)
        if cls is None:
            raise Absent(f"transformers {transformers.__version__} has no {name}ForCausalLM")
        config_class = getattr(transformers, CONFIG_CLASS.get(name, ""), cls.config_class)
        cfg = config_class(**{**LLM_BASE, **LLMS[name]})
        torch.manual_seed(0)
        return _no_zero_weights(cls(cfg)).eval().to(device=device, dtype=dtype)
    else:
        cls = getattr(transformers, name + "ForCausalLM")
        cfg = getattr(transformers, name + "Config")(**{**BASE, **ARCHITECTURES[name]})
    torch.manual_seed(0)
    return cls(cfg).eval().to(device=device, dtype=dtype)


def _no_zero_weights(model):
    """Weights initialised to all zeros given small random values: a zero router
    (Afmoe's) scores every expert 0.5, and the order of tied top-k picks is each
    implementation's own (torch's CPU and CUDA kernels differ), not a check of kiln."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() > 1 and not p.any():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.02)
    return model


class Case:
    """One row's model, its example and fresh call (args, kwargs) and the tensor
    compared; `model32` builds the same model in fp32 for the low-precision reference."""

    def __init__(self, model, example, fresh, model32, pick=lambda out: out):
        self.model, self.example, self.fresh = model, example, fresh
        self.model32, self.pick = model32, pick

    def call(self, fn, inputs=None, dtype=None):
        args, kwargs = inputs or self.fresh
        if dtype is not None:
            args = [_cast(v, dtype) for v in args]
            kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        with torch.no_grad():
            return self.pick(fn(*args, **kwargs))


def _cast(value, dtype):
    floating = isinstance(value, torch.Tensor) and value.is_floating_point()
    return value.to(dtype) if floating else value


def forward_case(name: str, dtype, device, tokens: int = 9) -> Case:
    g = torch.Generator().manual_seed(2)
    example, fresh = (torch.randint(0, 100, (2, tokens), generator=g).to(device) for _ in "ab")
    return Case(forward_model(name, dtype, device), ((example,), {"use_cache": False}),
                ((fresh,), {"use_cache": False}),
                lambda: forward_model(name, torch.float32, device), lambda out: out.logits)


def model_case(name: str, dtype, device) -> Case:
    build, inputs = zoo_models.MODELS[name]

    def on_device(kw):
        return {k: v.to(device, dtype if v.is_floating_point() else v.dtype)
                if isinstance(v, torch.Tensor) else v for k, v in kw.items()}

    def model_in(dt):
        torch.manual_seed(0)
        return build().eval().to(device=device, dtype=dt)

    torch.manual_seed(1)
    example = on_device(inputs())
    torch.manual_seed(2)
    fresh = on_device(inputs())
    return Case(model_in(dtype), ((), example), ((), fresh), lambda: model_in(torch.float32),
                first_tensor)


CASES = {"forward": forward_case, "llms": forward_case, "models": model_case}


def run_case(set_name: str, name: str, args) -> str:
    """kiln against eager on fresh inputs; a mismatch is also checked against
    torch.export's own module, since a model that traces another program than it runs
    (transformers 5.17's Doge skips its causal mask in eager only) is not kiln's error."""
    dtype = getattr(torch, args.dtype)
    case = (CASES[set_name](name, dtype, args.device) if set_name == "models" else
            CASES[set_name](name, dtype, args.device, args.tokens))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KilnWarning)
        exe = kiln.compile(case.model, *case.example, target=args.target,
                           options=share_options(args))
    out, ref = case.call(exe), case.call(case.model)
    err32 = eager32 = None
    if dtype != torch.float32:
        ref32 = case.call(case.model32(), dtype=torch.float32)
        err32, eager32 = rel(out, ref32), rel(ref, ref32)
    text = verdict(rel(out, ref), err32, eager32, args.tol)
    if text.startswith("MISMATCH"):
        with torch.no_grad():
            traced = torch.export.export(case.model, *case.example).module()
        exported = case.call(traced)
        if rel(exported, ref) > args.tol and rel(out, exported) < args.tol:
            text = (f"traced differs: kiln vs torch.export {rel(out, exported):.1e}, "
                    f"torch.export vs eager {rel(exported, ref):.1e}")
    return text


def share_options(args) -> dict:
    """Each of the --jobs processes compiles with its share of the host's cores: a
    process's compile pool is a worker per core, and 15 processes of 15 workers on the
    H200 host's 16 cores finished no LLM row in 265 s."""
    return {"tune_workers": max(1, (os.cpu_count() or 2) // args.jobs)}


def run_recipe(name: str, args) -> str:
    dtype, device = getattr(torch, args.dtype), args.device
    model = zi.build(name, dtype).to(device)
    steps = zi.calls(model.config.vocab_size, args.prompt, device)
    try:
        ref = zi.eager_logits(model, steps, args.cache_len)
    except Exception as e:  # transformers' own recipe: not kiln's row to fail
        raise EagerFails(e) from e
    outs = zi.kiln_logits(model, steps, args.cache_len, args.target, args.prompt + 1,
                          cache=True)
    err = max(rel(o, r) for o, r in zip(outs, ref))
    err32 = eager32 = None
    if dtype != torch.float32:
        ref32 = zi.eager_logits(zi.build(name, torch.float32).to(device), steps,
                                args.cache_len)
        err32 = max(rel(o, r) for o, r in zip(outs, ref32))
        eager32 = max(rel(o, r) for o, r in zip(ref, ref32))
    return verdict(err, err32, eager32, args.tol)


def first_tensor(out):
    """The output compared: a tensor, else logits / last_hidden_state / ..., else [0]."""
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "prediction_outputs", "predicted_depth", "last_hidden_state",
                "pooler_output"):
        value = getattr(out, key, None)
        if value is not None:
            return value
    return out[0]


RUNS = {"forward": (ARCHITECTURES, lambda name, args: run_case("forward", name, args)),
        "recipe": (zi.FAMILIES, run_recipe),
        "llms": (LLMS, lambda name, args: run_case("llms", name, args)),
        "models": (zoo_models.MODELS, lambda name, args: run_case("models", name, args))}


def rows(args) -> list[tuple[str, str]]:
    only = {n for n in args.only.split(",") if n}
    return [(s, n) for s in args.sets.split(",") for n in RUNS[s][0] if not only or n in only]


def run_share(args) -> None:
    """Run this process's share of the rows, one JSON line each."""
    mine = rows(args)[args.share::args.jobs]
    for set_name, name in mine:
        t0 = time.perf_counter()
        try:
            result = RUNS[set_name][1](name, args)
        except Exception as e:  # one architecture's failure is a row of the table
            if args.verbose:
                traceback.print_exc()
            cause = e.__cause__ if isinstance(e, EagerFails) else e
            first = (str(cause).strip().splitlines() or [""])[0]
            result = f"{type(cause).__name__}: {first}"[:160]
            if isinstance(e, EagerFails):
                result = "eager fails: " + result
            if isinstance(e, Absent):
                result = f"absent: {e}"
        print(json.dumps({"set": set_name, "name": name, "result": result,
                          "s": round(time.perf_counter() - t0, 1)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sets", default="forward,recipe,models,llms")
    p.add_argument("--only", default="")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--target", default="cuda")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--share", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--tol", type=float, default=None, help="fp32 1e-5, else 1e-2")
    p.add_argument("--tokens", type=int, default=9,
                   help="forward / llms: ids per row (over 16: a prefill attention tile)")
    p.add_argument("--prompt", type=int, default=5)
    p.add_argument("--cache-len", type=int, default=16)
    p.add_argument("--json", default=None)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    args.device = "cpu" if args.target in ("cpu", "interpret") else "cuda"
    if args.tol is None:
        args.tol = 1e-5 if args.dtype == "float32" else 1e-2
    if args.share is not None:
        return run_share(args)
    t0 = time.perf_counter()
    # one pipe for every share, so a row prints when it ends (a run cut by a timeout
    # keeps every row done); a JSON line is far under PIPE_BUF and so never interleaved
    read_end, write_end = os.pipe()
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--share", str(i)],
                              stdout=write_end) for i in range(args.jobs)]
    os.close(write_end)
    results = []
    with os.fdopen(read_end) as merged:
        for line in merged:
            if line.startswith("{"):
                row = json.loads(line)
                results.append(row)
                print(f"{row['set']:8} {row['name']:18} {row['result']:70} {row['s']:6.1f}",
                      flush=True)
    for proc in procs:
        proc.wait()
    counts: dict[str, dict[str, int]] = {}
    for row in results:
        kind = row["result"].split()[0]
        kind = {"ok": "ok", "MISMATCH": "MISMATCH", "eager": "eager fails",
                "traced": "traced differs", "absent:": "absent"}.get(kind, "error")
        counts.setdefault(row["set"], dict.fromkeys(("ok", "MISMATCH", "error", "eager fails",
                                                     "traced differs", "absent"), 0))[kind] += 1
    for set_name, c in counts.items():
        print(f"{set_name}: " + ", ".join(f"{k} {v}" for k, v in c.items()))
    print(f"{args.target} {args.dtype}, {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "dtype": args.dtype, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name() if args.device == "cuda"
                       else "cpu", "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
