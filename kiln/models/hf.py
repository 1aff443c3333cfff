"""Hugging Face checkpoints: config.json -> a model config (LlamaConfig, or
Qwen3NextConfig), *.safetensors -> the loaded model (Llama or Qwen3Next).

The model is built on the meta device (no memory) and every tensor is read from its
safetensors file, converted to the requested dtype and device, and assigned into the
module, one tensor at a time and shard by shard: an 8B model never needs two copies.
Every header is checked before any tensor is read (names, shapes, truncation), so a
bad checkpoint fails fast; if reading still fails, the partial module is freed.
"""

from __future__ import annotations

import json
import logging
import traceback
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from kiln.errors import CheckpointError, ShapeError
from kiln.models import fp8
from kiln.models.llama import ROPE_TYPES, Llama, LlamaConfig
from kiln.models.moe import EXPERT_WEIGHTS, Experts, checkpoint_slot
from kiln.models.qwen3_next import Qwen3Next, Qwen3NextConfig
from kiln.models.rank_weights import RankReader, reading
from kiln.progress import progress

log = logging.getLogger("kiln.models")

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3NextForCausalLM": "qwen3_next"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_MAX_SEQ_LEN = 4096  # the KV cache's length unless the caller asks for more
INDEX = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # old Llama checkpoints store RoPE tables
IGNORED_PREFIXES = ("mtp.",)  # Qwen3-Next's multi-token-prediction head (kiln decodes 1)


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path.name} is missing from {path.parent}",
                              where=str(path),
                              hint="point --model at a Hugging Face checkpoint directory "
                              "(config.json and *.safetensors)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path.name} is not valid JSON: {e}", where=str(path)) from None
    except OSError as e:  # a directory of that name, no permission
        raise CheckpointError(f"cannot read {path.name}: {e.strerror or e}",
                              where=str(path)) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path.name} holds a JSON {type(data).__name__}, not an object",
                              where=str(path), hint="a Hugging Face checkpoint's "
                              f"{path.name} is one JSON object")
    return data


# config.json entries that are sizes or counts: positive ints when present (null only
# for NULLABLE ones, which then take their defaults)
NULLABLE = ("num_key_value_heads", "head_dim", "sliding_window", "q_lora_rank")
# counts that may be 0: Qwen3-Next with num_experts 0 has a dense MLP in every layer
MAY_BE_ZERO = ("num_experts",)
SIZE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "intermediate_size", "head_dim",
             "max_position_embeddings", "sliding_window", "moe_intermediate_size",
             "n_routed_experts", "num_experts", "num_experts_per_tok", "q_lora_rank",
             "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
             "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim", "linear_conv_kernel_dim", "decoder_sparse_step",
             "full_attention_interval")

# entries that are real numbers when present; RoPE parameters that are numbers when not
# null. A string or null one failed later as a raw TypeError, or inside the compile.
NUMBER_KEYS = ("rms_norm_eps", "routed_scaling_factor")
ROPE_NUMBER_KEYS = ("factor", "original_max_position_embeddings", "attention_factor",
                    "mscale", "mscale_all_dim", "beta_fast", "beta_slow", "low_freq_factor",
                    "high_freq_factor")


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def check_config_values(hf: dict, where: str, head_dim_from_hidden: bool = True) -> None:
    """Every size in config.json is a positive int (MAY_BE_ZERO's counts may be 0), every
    NUMBER_KEYS entry a number, the heads divide as attention needs and the RoPE entry is
    an object of numbers; a 0, -1 or "x" used to fail deep inside torch (negative dims,
    // by zero) or as a raw TypeError."""
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise CheckpointError(f"config.json's {key} is {hf[key]!r}, not an object",
                                  where=where)
    for key in SIZE_KEYS:
        v = hf.get(key)
        if key not in hf or (v is None and key in NULLABLE):
            continue
        least = 0 if key in MAY_BE_ZERO else 1
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise CheckpointError(f"config.json's {key} is {v!r}, not a "
                                  f"{'non-negative' if least == 0 else 'positive'} int",
                                  where=where)
    for key in NUMBER_KEYS:
        if key in hf and not _is_number(hf[key]):
            raise CheckpointError(f"config.json's {key} is {hf[key]!r}, not a number",
                                  where=where)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    for key in ROPE_NUMBER_KEYS:
        if rope.get(key) is not None and not _is_number(rope[key]):
            raise CheckpointError(f"config.json's RoPE {key} is {rope[key]!r}, not a number",
                                  where=where)
    heads, kv = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise CheckpointError(f"num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv}", where=where,
                              hint="grouped-query attention shares each key/value head "
                              "among a whole number of query heads")
    dim = hf.get("hidden_size")
    if head_dim_from_hidden and heads and dim and hf.get("head_dim") is None and dim % heads:
        raise CheckpointError(f"hidden_size {dim} is not a multiple of num_attention_heads "
                              f"{heads}, and config.json gives no head_dim", where=where)


def maps(hf: dict) -> bool:
    """Does config.json name a family this loader maps onto kiln's own modules?"""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    return arch in ARCHITECTURES or (arch is None
                                     and hf.get("model_type") in ARCHITECTURES.values())


def family(hf: dict, where: str) -> str:
    """'llama' | 'mistral' | 'qwen2' | 'qwen3' | 'qwen3_next' from config.json's architectures (or
    model_type)."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch in ARCHITECTURES:
        return ARCHITECTURES[arch]
    if arch is None and hf.get("model_type") in ARCHITECTURES.values():
        return hf["model_type"]
    if arch == "DeepseekV3ForCausalLM" or hf.get("model_type") == "deepseek_v3":
        raise CheckpointError(
            "a DeepSeek-V3 config is not one of the Llama-like families this loader maps",
            where=where, hint="load it with kiln.models.load (it picks "
            "kiln.models.deepseek_v3_checkpoint), or call that module's config_from_hf")
    raise CheckpointError(
        f"architecture {arch or hf.get('model_type')!r} is not supported",
        where=where,
        hint=f"this loader maps {', '.join(ARCHITECTURES)} onto kiln's models (DeepSeek-V3: "
        "deepseek_v3_checkpoint); kiln.models.load runs other transformers causal LMs "
        "through kiln.models.hf_recipe")


def context_length(hf: dict, where: str, max_seq_len: int | None) -> int:
    """The context kiln's caches cover: max_seq_len, within max_position_embeddings."""
    max_pos = hf.get("max_position_embeddings", DEFAULT_MAX_SEQ_LEN)
    if max_seq_len is None:
        return min(max_pos, DEFAULT_MAX_SEQ_LEN)
    if max_seq_len > max_pos:
        raise ShapeError(f"max_seq_len {max_seq_len} exceeds the model's "
                         f"max_position_embeddings {max_pos}", where=where)
    return max_seq_len


def config_from_hf(hf: dict, where: str = "config.json",
                   max_seq_len: int | None = None) -> LlamaConfig | Qwen3NextConfig:
    """Map a Hugging Face config.json (dict) onto LlamaConfig (or Qwen3NextConfig for a
    Qwen3-Next checkpoint); reject what kiln cannot run."""
    fam = family(hf, where)
    check_config_values(hf, where, head_dim_from_hidden=fam != "qwen3_next")  # 256 there
    if fam == "qwen3_next":
        return Qwen3NextConfig.from_hf(hf, context_length(hf, where, max_seq_len), where)
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' ACT2FN: "swish" is SiLU
        raise CheckpointError(f"hidden_act {act!r} is not supported", where=where,
                              hint="kiln's Llama family uses SwiGLU (silu)")
    theta, kind, rope = rope_from_hf(hf, where, (*ROPE_TYPES, "dynamic"))
    if kind == "dynamic":
        # dynamic NTK rescales theta only past max_position_embeddings, which kiln's
        # context never passes (context_length): within it, transformers' default RoPE
        kind = "default"
        rope = {k: v for k, v in rope.items() if k == "partial_rotary_factor"}
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError("partial rotary embeddings are not supported", where=where)
    factor = rope.get("factor")
    if kind in ("linear", "llama3") and (not isinstance(factor, int | float)
                                         or isinstance(factor, bool) or not factor > 0):
        # rope_inv_freq divides by it: a missing one was a raw KeyError at load, a 0 NaN logits
        raise CheckpointError(f"config.json's {kind} RoPE scaling has factor {factor!r}, "
                              "not a positive number", where=where,
                              hint="its \"factor\" is how many times the context is "
                              "stretched (8.0 for Llama 3.1)")
    if kind == "llama3" and "original_max_position_embeddings" not in rope:
        rope["original_max_position_embeddings"] = hf.get("max_position_embeddings", 8192)
    max_seq_len = context_length(hf, where, max_seq_len)
    attention_bias = bool(hf.get("attention_bias", False))
    window, sliding_layers = None, None
    if fam == "mistral":
        window = hf.get("sliding_window")
    elif fam in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        window = hf.get("sliding_window")
        types = hf.get("layer_types")
        n = hf["num_hidden_layers"]
        if types:
            sliding_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        else:
            sliding_layers = tuple(range(hf.get("max_window_layers", n), n))
    try:
        return LlamaConfig(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            head_dim=hf.get("head_dim"),
            rope_theta=float(theta),
            rope_scaling=rope if kind != "default" else None,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_seq_len=max_seq_len,
            qkv_bias=fam == "qwen2" or attention_bias,
            o_bias=fam in ("llama", "qwen3") and attention_bias,
            qk_norm=fam == "qwen3",
            mlp_bias=fam == "llama" and bool(hf.get("mlp_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=window,
            sliding_layers=sliding_layers,
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks {e.args[0]!r}", where=where) from None


def build_model(cfg: LlamaConfig | Qwen3NextConfig) -> Llama | Qwen3Next:
    """The model class the config describes (on the current default device)."""
    return Qwen3Next(cfg) if isinstance(cfg, Qwen3NextConfig) else Llama(cfg)


def rope_from_hf(hf: dict, where: str, supported) -> tuple[float, str, dict]:
    """(theta, RoPE type, its parameters) from a config.json; an unsupported type is an
    error. transformers >= 5 writes rope_parameters; older configs rope_theta +
    rope_scaling."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise CheckpointError(f"config.json's rope_theta is {theta!r}, not a positive "
                              "number", where=where)
    theta = float(theta)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in supported:
        raise CheckpointError(f"RoPE type {kind!r} is not supported", where=where,
                              hint=f"supported: {', '.join(supported)}")
    return theta, kind, rope


def checkpoint_dtype(hf: dict) -> torch.dtype | None:
    return DTYPES.get(hf.get("dtype") or hf.get("torch_dtype") or "")


def stop_token_ids(path: Path, hf: dict) -> set[int]:
    """eos_token_id from config.json and generation_config.json (an int or a list)."""
    ids: set[int] = set()
    sources = [hf]
    gen = path / "generation_config.json"
    if gen.is_file():
        sources.append(read_json(gen))
    for src in sources:
        eos = src.get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


# ---- weights --------------------------------------------------------------------------


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: those the index names, or every *.safetensors."""
    index = path / INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{INDEX} has no weight_map", where=str(index))
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"shard {f.name} named in {INDEX} is missing",
                                      where=str(f), hint="download the checkpoint again")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}", where=str(path),
                              hint="kiln reads safetensors checkpoints (not .bin / .pth)")
    return files


def read_headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor's file and shape, from the headers alone (no tensor data is read)."""
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not iterable
                    found[name] = (f, tuple(st.get_slice(name).get_shape()))
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {f.name}: {e}", where=str(f),
                                  hint="the file is truncated or corrupt: download it "
                                  "again") from None
    return found


def check_tensors(model: nn.Module, found: dict) -> dict[str, tuple[str, int | None]]:
    """checkpoint name -> (the model parameter it fills, the expert's slot when that is
    a stacked Experts tensor, else None); raises for a missing tensor, a wrong shape or
    one the model lacks."""
    want = {n: tuple(p.shape) for n, p in model.named_parameters()}  # tied ones once
    stacked = {f"{name}.{w}" for name, m in model.named_modules() if isinstance(m, Experts)
               for w in EXPERT_WEIGHTS}
    expected = {(n, None) for n in want if n not in stacked}
    expected |= {(n, e) for n in stacked for e in range(want[n][0])}
    mapping = {}
    for name in found:
        target = checkpoint_slot(name) or (name, None)
        if target in expected:
            mapping[name] = target
    missing = sorted(expected - set(mapping.values()), key=lambda t: (t[0], t[1] or 0))
    if missing:
        names = [n if e is None else f"{n}[expert {e}]" for n, e in missing]
        raise CheckpointError(
            f"{len(names)} tensor(s) missing from the checkpoint: {', '.join(names[:4])}"
            + (" ..." if len(names) > 4 else ""),
            hint="the checkpoint does not match its config.json (layers, tied embeddings, "
            "experts)")
    for name, (dest, slot) in mapping.items():
        f, got = found[name]
        shape = want[dest] if slot is None else want[dest][1:]
        if got != shape:
            raise ShapeError(f"tensor {name} in {f.name} has shape {list(got)}, config.json "
                             f"implies {list(shape)}", where=str(f))
    extra = [n for n in found if n not in mapping and not n.endswith(IGNORED_SUFFIXES)
             and not n.startswith(IGNORED_PREFIXES)
             and not (n == "lm_head.weight" and model.cfg.tie_word_embeddings)]
    if extra:
        raise CheckpointError(
            f"the checkpoint has {len(extra)} tensor(s) the model lacks: "
            f"{', '.join(extra[:4])}" + (" ..." if len(extra) > 4 else ""),
            hint="config.json does not describe this checkpoint (layer count, biases?)")
    return mapping


def place(model: nn.Module, name: str, slot: int | None, tensor: torch.Tensor) -> None:
    """Make `tensor` the parameter `name` of `model`, or, with a slot, copy it into that
    expert's slot of the stacked parameter (allocated, in tensor's dtype and device,
    when its first expert arrives)."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    if slot is None:
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
        return
    current = getattr(module, attr)
    if current.is_meta:
        current = nn.Parameter(torch.empty(current.shape, dtype=tensor.dtype,
                                           device=tensor.device), requires_grad=False)
        setattr(module, attr, current)
    with torch.no_grad():
        current[slot].copy_(tensor)


def _dtype_of(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint tensor loads as: the model's, except an fp8 checkpoint's
    e4m3 weights and their fp32 block scales (kiln.models.fp8), kept as they are."""
    if t.dtype == torch.float8_e4m3fn:
        return t.dtype
    return torch.float32 if name.endswith(".weight_scale_inv") else dtype


def load_weights(model: nn.Module, files: list[Path], dtype: torch.dtype, device) -> None:
    """Read every tensor of the checkpoint into `model` (built on the meta device)."""
    found = read_headers(files)
    mapping = check_tensors(model, found)
    by_file: dict[Path, list[str]] = {}
    for n in mapping:
        by_file.setdefault(found[n][0], []).append(n)
    total = sum(f.stat().st_size for f in by_file)
    with progress(total=total, desc="loading weights", unit="B", unit_scale=True) as bar:
        for f, file_names in by_file.items():
            with reading(f), safe_open(str(f), framework="pt") as st:
                for n in file_names:
                    t = st.get_tensor(n)
                    bar.update(t.nbytes)
                    # copy=True: safetensors' tensors sit at unaligned addresses, and CPU
                    # BLAS rounds differently there than on torch's aligned memory
                    place(model, *mapping[n], t.to(device=device, dtype=_dtype_of(n, t, dtype),
                                                   copy=True))
                    del t
    model.tie_weights()


def rank_reader(model: nn.Module, path: Path, device, quantize: bool = False) -> RankReader:
    """The reader of a multi-device plan's rank for checkpoint `path` (its headers
    checked against `model`, on the meta device, now: before any compiling); with
    `quantize` the model takes quantize="fp8"'s layout and each rank's slices are
    quantised as read. See rank_weights.py."""
    found = read_headers(weight_files(path))
    mapping = check_tensors(model, found)
    dtype = model.lm_head.weight.dtype
    if quantize:
        fp8.use_quantized_layout(model)
    return RankReader(model, found, mapping, dtype, device)


def free_partial(model: nn.Module, exc: BaseException) -> None:
    """Drop what a failed load put into `model`, even while the exception is alive.

    The traceback keeps every frame's locals (the module, the tensor being read);
    clearing those frames and moving the module to meta releases the memory.
    """
    model.to("meta")
    while exc is not None:
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def load_checkpoint(path, dtype: torch.dtype | None = None, device="cpu",
                    max_seq_len: int | None = None, weights: bool = True,
                    keep_fp8: bool | None = None) -> tuple[Llama | Qwen3Next, dict]:
    """(model, config.json) for a Hugging Face checkpoint directory; weights loaded lazily.

    weights=False leaves the weights on the meta device (a multi-device plan reads each
    rank's slices later, with rank_reader); the model is in `dtype` already, its fp8
    projections (an fp8 checkpoint's) in float8_e4m3fn.
    An fp8 checkpoint always loads as fp8 here (keep_fp8=False is refused; True for a
    checkpoint without fp8 weights too): see fp8.keeps_fp8.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist", where=str(path))
    hf = read_json(path / "config.json")
    cfg = config_from_hf(hf, str(path / "config.json"), max_seq_len)
    files = weight_files(path)
    dtype = dtype or checkpoint_dtype(hf) or torch.float32
    with torch.device("meta"):
        model = build_model(cfg)
    on_gpu = torch.device(device).type == "cuda"
    if not weights:  # shapes only, RoPE tables too: every tensor on one device for export
        model = model.to(dtype)
        model.init_rope("meta")
    if fp8.keeps_fp8(keep_fp8, hf, on_gpu, str(path / "config.json"), can_dequantize=False):
        # e4m3 weights + block scales load as they are
        if not isinstance(model, Llama):
            raise CheckpointError("fp8 checkpoints load for the Llama families",
                                  where=str(path / "config.json"))
        fp8.use_fp8_layout(model, hf, str(path / "config.json"))
    if not weights:
        return model.eval(), hf
    try:
        load_weights(model, files, dtype, device)
    except BaseException as e:
        free_partial(model, e)
        del model
        raise
    model.init_rope(device)
    log.info("loaded %s (%d shard(s)) as %s on %s", path, len(files), dtype, device)
    return model.eval(), hf


def random_model(cfg: LlamaConfig | Qwen3NextConfig, dtype: torch.dtype = torch.float32,
                 device="cpu", seed: int = 0, std: float = 0.02) -> Llama | Qwen3Next:
    """A model with random weights (normal(0, std); norms 1, biases 0), made in place."""
    with torch.device("meta"):
        model = build_model(cfg)
    model = init_random(model, dtype, device, seed, std)
    model.init_rope(device)
    return model.eval()


def init_random(model: torch.nn.Module, dtype: torch.dtype, device, seed: int,
                std: float) -> torch.nn.Module:
    """`model` (built on the meta device) materialised on `device` in `dtype` with random
    weights: matrices normal(0, std), norms 1, other vectors 0. Every model's random
    weights follow this one rule, so a seed means the same thing for each family."""
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, std, generator=gen)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.zero_()
    return model
