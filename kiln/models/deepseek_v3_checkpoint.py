"""DeepSeek-V3 checkpoints in Hugging Face's layout -> a loaded DeepseekV3.

Like hf.py for Llama: the model is built on the meta device, every header is checked
before any tensor is read, and tensors are read shard by shard, one at a time. What
is particular to DeepSeek-V3:

- routed experts are stored one tensor per expert
  (model.layers.L.mlp.experts.E.gate_proj.weight); each is copied into its slot of
  the layer's stacked [n_experts, ...] parameter;
- fp8 checkpoints (DeepSeek's own release): a linear weight stored as float8_e4m3fn
  comes with `<name>_scale_inv`, one fp32 scale per 128x128 block (the block size
  is config.json's quantization_config.weight_block_size); the scale may sit in
  another shard than its weight. With keep_fp8 (the default on GPUs) every
  projection stored so (attention's q / q_a / q_b, kv_a, kv_b, o; the dense MLPs'
  and shared experts' gate, up, down) becomes an fp8.Fp8Linear and takes the weight
  and scale as stored: no dequantised copy is ever made of them. Without it (the
  default on the CPU) each is dequantised at load (w * scale of its block) into the
  requested dtype;
- the routed experts are stacked per layer ([n_experts, ...]); with keep_fp8 an fp8
  checkpoint's experts become moe.Fp8Experts (e4m3 weights and their stacked block
  scales, as stored: 1 byte a weight, most of V3's 671B), run by the fp8 grouped MoE
  op; without it they are dequantised into the model's dtype like every projection;
- the multi-token-prediction layer (model.layers.<num_hidden_layers>...) is skipped;
- the router's e_score_correction_bias stays fp32, and so does its weight when the
  checkpoint stores it fp32 (transformers does: it keeps the router in fp32 whatever the
  model's dtype, and rounding it to bf16 changes some tokens' experts).

Under tensor parallelism (kiln.models.load(..., tensor_parallel_size=T)) the model is
built and compiled on the meta device and each rank reads only its slices
(rank_reader: kiln.models.rank_weights), its heads' W_UK / W_UV split out of their
kv_b_proj rows alone.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from kiln.errors import CheckpointError, ShapeError
from kiln.models import hf, rank_weights
from kiln.models.deepseek_v3 import ROPE_TYPES, DeepseekV3, DeepseekV3Config, absorbed_weights
from kiln.models.fp8 import is_fp8_checkpoint, keeps_fp8, use_fp8_layout, use_quantized_layout
from kiln.models.moe import checkpoint_slot, use_fp8_experts_layout
from kiln.progress import progress

log = logging.getLogger("kiln.models")

SCALE_SUFFIX = "_scale_inv"
FP32_SUFFIXES = ("e_score_correction_bias",)
ROUTER_WEIGHT = ".mlp.gate.weight"  # kept fp32 when stored fp32


def config_from_hf(hf_cfg: dict, where: str = "config.json",
                   max_seq_len: int | None = None) -> DeepseekV3Config:
    """Map a DeepSeek-V3 config.json (dict) onto DeepseekV3Config."""
    hf.check_config_values(hf_cfg, where, head_dim_from_hidden=False)
    act = hf_cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} is not supported", where=where,
                              hint="DeepSeek-V3 uses SwiGLU (silu)")
    scoring = hf_cfg.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise CheckpointError(f"scoring_func {scoring!r} is not supported", where=where,
                              hint="DeepSeek-V3 routes with sigmoid scores")
    theta, kind, rope = hf.rope_from_hf(hf_cfg, where, ROPE_TYPES)
    max_pos = hf_cfg.get("max_position_embeddings", hf.DEFAULT_MAX_SEQ_LEN)
    if kind == "yarn":
        # left out (older configs' rope_scaling): the model's context, as transformers
        # fills it in; indexing for it was a raw KeyError
        if rope.get("original_max_position_embeddings") is None:
            rope["original_max_position_embeddings"] = max_pos
        if rope.get("factor") is None:  # the reference's default
            rope["factor"] = max_pos / rope["original_max_position_embeddings"]
    max_seq_len = hf.context_length(hf_cfg, where, max_seq_len)
    kv_heads = hf_cfg.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != hf_cfg.get("num_attention_heads"):
        raise CheckpointError("num_key_value_heads differs from num_attention_heads",
                              where=where, hint="multi-head latent attention expands the "
                              "latent to every head")
    topk_method = hf_cfg.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise CheckpointError(f"topk_method {topk_method!r} is not supported", where=where,
                              hint="DeepSeek-V3 routes with noaux_tc (group-limited top-k "
                              "with a score correction bias)")
    try:
        return DeepseekV3Config(
            vocab_size=hf_cfg["vocab_size"],
            dim=hf_cfg["hidden_size"],
            n_layers=hf_cfg["num_hidden_layers"],
            n_heads=hf_cfg["num_attention_heads"],
            q_lora_rank=hf_cfg.get("q_lora_rank"),
            kv_lora_rank=hf_cfg["kv_lora_rank"],
            qk_nope_head_dim=hf_cfg["qk_nope_head_dim"],
            qk_rope_head_dim=hf_cfg["qk_rope_head_dim"],
            v_head_dim=hf_cfg["v_head_dim"],
            intermediate_size=hf_cfg["intermediate_size"],
            moe_intermediate_size=hf_cfg["moe_intermediate_size"],
            n_routed_experts=hf_cfg["n_routed_experts"],
            n_shared_experts=hf_cfg.get("n_shared_experts") or 0,
            n_experts_per_tok=hf_cfg["num_experts_per_tok"],
            n_group=hf_cfg.get("n_group") or 1,
            topk_group=hf_cfg.get("topk_group") or 1,
            norm_topk_prob=bool(hf_cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(hf_cfg.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=hf_cfg.get("first_k_dense_replace") or 0,
            rope_theta=float(theta),
            rope_scaling=rope if kind != "default" else None,
            rope_interleave=bool(hf_cfg.get("rope_interleave", True)),
            norm_eps=hf_cfg.get("rms_norm_eps", 1e-6),
            max_seq_len=max_seq_len,
            attention_bias=bool(hf_cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(hf_cfg.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks {e.args[0]!r}", where=where) from None
    except ShapeError as e:
        raise ShapeError(e.what, where=where, hint=e.hint) from None


def block_size(hf_cfg: dict) -> tuple[int, int]:
    q = hf_cfg.get("quantization_config") or {}
    return tuple(q.get("weight_block_size") or (128, 128))


def dequantize_blocks(w: torch.Tensor, scale_inv: torch.Tensor,
                      block: tuple[int, int]) -> torch.Tensor:
    """w [R, C] (fp8) times the scale of its block: scale_inv [ceil(R/br), ceil(C/bc)]."""
    R, C = w.shape
    br, bc = block
    want = (-(-R // br), -(-C // bc))
    if tuple(scale_inv.shape) != want:
        raise ShapeError(f"a {R}x{C} weight in {br}x{bc} blocks needs {list(want)} scales, "
                         f"got {list(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(br, 0)[:R].repeat_interleave(bc, 1)[:, :C]
    return w.float() * scale


# ---- names ----------------------------------------------------------------------------


def _target(name: str, cfg: DeepseekV3Config) -> tuple[str, int | None] | None:
    """The model tensor a checkpoint tensor fills: (name, expert slot or None); None to
    skip it (the multi-token-prediction layer, stored RoPE tables)."""
    parts = name.split(".")
    if name.endswith(hf.IGNORED_SUFFIXES):
        return None
    if parts[:2] == ["model", "layers"] and int(parts[2]) >= cfg.n_layers:
        return None  # multi-token prediction
    stacked = checkpoint_slot(name)
    if stacked is not None:
        return stacked
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None
    return name, None


def tensor_map(model: DeepseekV3, found: dict) -> dict[str, tuple[str, int | None]]:
    """checkpoint name -> (model tensor, expert slot); raises for a missing tensor,
    an unknown one, or a wrong shape."""
    cfg = model.cfg
    want = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    if cfg.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    filled: dict[str, set] = {n: set() for n in want}
    mapping, extra = {}, []
    for name, (f, shape) in found.items():
        try:
            target = _target(name, cfg)
        except (ValueError, IndexError):
            target = (name, None)
        if target is None:
            continue
        dest, slot = target
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in found \
                and dest not in want:
            continue  # read with its weight, to dequantise it (no Fp8Linear/Experts holds it)
        if dest not in want and 0 in shape:
            continue  # empty: transformers' zero-width shared expert (moe.MoE has none)
        if dest not in want or (slot is not None and not 0 <= slot < want[dest][0]):
            extra.append(name)
            continue
        expect = want[dest] if slot is None else want[dest][1:]
        if tuple(shape) != expect:
            raise ShapeError(f"tensor {name} in {f.name} has shape {list(shape)}, "
                             f"config.json implies {list(expect)}", where=str(f))
        filled[dest].add(slot)
        mapping[name] = target
    if extra:
        raise CheckpointError(
            f"the checkpoint has {len(extra)} tensor(s) the model lacks: "
            f"{', '.join(extra[:4])}" + (" ..." if len(extra) > 4 else ""),
            hint="config.json does not describe this checkpoint (layers, experts?)")
    missing = [n for n, got in filled.items()
               if not got or (None not in got and len(got) != want[n][0])]
    if missing:
        raise CheckpointError(
            f"{len(missing)} tensor(s) missing from the checkpoint: {', '.join(missing[:4])}"
            + (" ..." if len(missing) > 4 else ""),
            hint="the checkpoint does not match its config.json (layers, experts)")
    return mapping


def check_scales(found: dict, block: tuple[int, int]) -> None:
    """Every weight's block scales have the shape its blocks need (headers only)."""
    for name, (f, shape) in found.items():
        weight = name.removesuffix(SCALE_SUFFIX)
        if name == weight or weight not in found or len(found[weight][1]) != 2:
            continue
        (R, C), (br, bc) = found[weight][1], block
        want = (-(-R // br), -(-C // bc))
        if tuple(shape) != want:
            raise ShapeError(f"{name} has shape {list(shape)}; a {R}x{C} weight in "
                             f"{br}x{bc} blocks needs {list(want)} scales", where=str(f))


# ---- loading --------------------------------------------------------------------------


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner, _, attr = name.rpartition(".")
    return model.get_submodule(owner), attr


def _place(model: nn.Module, name: str, slot: int | None, t: torch.Tensor,
           dtype: torch.dtype, device) -> None:
    module, attr = _owner(model, name)
    current = getattr(module, attr)
    if current.dtype == torch.float8_e4m3fn:  # an Fp8Linear's weight, as stored
        dtype = current.dtype
    elif name.endswith(FP32_SUFFIXES) or name.endswith(SCALE_SUFFIX) or (
            name.endswith(ROUTER_WEIGHT) and t.dtype == torch.float32):
        dtype = torch.float32
    t = t.to(device=device, dtype=dtype)
    if slot is None and not isinstance(current, nn.Parameter):
        setattr(module, attr, t)  # a buffer (the router's score correction)
    else:
        hf.place(model, name, slot, t)


def _read(n: str, t: torch.Tensor, dest: str, model: nn.Module, found: dict, opened,
          block: tuple[int, int], device) -> torch.Tensor:
    """Checkpoint tensor `n` as `dest` takes it: as stored for an Fp8Linear's fp8
    weight (nothing dequantised), dequantised for any other weight with a scale. The
    dequantisation runs on `device`: V3's routed experts are thousands of tensors, and
    the CPU took ~0.1 s a tensor where a GPU takes well under a millisecond."""
    scale_name = n + SCALE_SUFFIX
    where = str(found[n][0])
    if getattr(*_owner(model, dest)).dtype == torch.float8_e4m3fn:
        if t.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{n} comes with {scale_name} but is stored as "
                                  f"{t.dtype}; kiln's fp8 linear takes float8_e4m3fn",
                                  where=where, hint="keep_fp8=False dequantises it at load")
        return t
    if scale_name in found:
        scale = opened(found[scale_name][0]).get_tensor(scale_name)
        return dequantize_blocks(t.to(device), scale.to(device), block)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CheckpointError(f"fp8 tensor {n} has no {scale_name}", where=where)
    return t


def load_weights(model: DeepseekV3, found: dict, dtype: torch.dtype, device,
                 block: tuple[int, int]) -> None:
    """Read every tensor of the checkpoint (`found`: hf.read_headers) into `model`
    (built on the meta device)."""
    mapping = tensor_map(model, found)
    check_scales(found, block)
    by_file: dict[Path, list[str]] = {}
    for n in mapping:
        by_file.setdefault(found[n][0], []).append(n)
    total = sum(f.stat().st_size for f in by_file)
    with contextlib.ExitStack() as stack, \
            progress(total=total, desc="loading weights", unit="B", unit_scale=True) as bar:
        handles = {}

        def opened(f: Path):
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(str(f), framework="pt"))
            return handles[f]

        for f, names in by_file.items():
            with hf.reading(f):
                for n in names:
                    t = opened(f).get_tensor(n)
                    bar.update(t.nbytes)
                    dest, slot = mapping[n]
                    t = _read(n, t, dest, model, found, opened, block, device)
                    _place(model, dest, slot, t, dtype, device)
                    del t
    model.tie_weights()


def _stored_dtype(found: dict, name: str) -> str | None:
    """The safetensors dtype ("F32", "BF16", ...) `name` is stored in, from its header."""
    if name not in found:
        return None
    with safe_open(str(found[name][0]), framework="pt") as f:
        return f.get_slice(name).get_dtype()


def fp8_expert_layers(found: dict, cfg: DeepseekV3Config) -> list[int]:
    """The decoder layers whose routed experts the checkpoint stores in fp8 (expert 0's
    gate_proj comes with its block scales; tensor_map requires the rest)."""
    return [i for i in range(cfg.n_layers)
            if f"model.layers.{i}.mlp.experts.0.gate_proj.weight{SCALE_SUFFIX}" in found]


def load_checkpoint(path, dtype: torch.dtype | None = None, device="cpu",
                    max_seq_len: int | None = None, keep_fp8: bool | None = None,
                    weights: bool = True) -> tuple[DeepseekV3, dict]:
    """(model, config.json) for a DeepSeek-V3 checkpoint directory; weights loaded lazily.

    dtype defaults to config.json's, and to bfloat16 for an fp8 checkpoint.
    keep_fp8: an fp8 checkpoint's projections load as fp8 (fp8.Fp8Linear) or are
    dequantised into dtype; None (default) keeps them on a GPU device and dequantises
    them on the CPU. True for a checkpoint without fp8 weights is an ArgumentError.
    weights=False leaves the model on the meta device, in the dtypes and fp8 layout it
    would load with: a multi-device plan reads each rank's slices later (rank_reader)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist", where=str(path))
    where = str(path / "config.json")
    hf_cfg = hf.read_json(path / "config.json")
    cfg = config_from_hf(hf_cfg, where, max_seq_len)
    method = (hf_cfg.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "fp8"):  # else their tensors were "tensors the model lacks"
        raise CheckpointError(f"quantization_config.quant_method {method!r} is not "
                              "supported", where=where, hint="kiln reads DeepSeek-V3 "
                              "weights unquantised or in DeepSeek's block-scaled fp8 "
                              "(quant_method 'fp8'): load such a copy, or quantize='fp8'")
    keep = keeps_fp8(keep_fp8, hf_cfg, torch.device(device).type == "cuda", where)
    files = hf.weight_files(path)
    dtype = dtype or hf.checkpoint_dtype(hf_cfg) or (
        torch.bfloat16 if is_fp8_checkpoint(hf_cfg) else torch.float32)
    found = hf.read_headers(files)
    with torch.device("meta"):
        model = DeepseekV3(cfg)
    if not weights:
        model = model.to(dtype)
        # RoPE tables in fp32, as init_rope makes them when the ranks' weights arrive: a
        # plan exported over bf16 ones dropped the model's casts, and its first call put
        # fp32 latents into the bf16 cache
        model.init_rope("meta")
        for i, layer in enumerate(model.model.layers):  # as _place keeps them
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias = gate.e_score_correction_bias.float()
                if _stored_dtype(found, f"model.layers.{i}{ROUTER_WEIGHT}") == "F32":
                    gate.weight = nn.Parameter(gate.weight.float(), requires_grad=False)
    if keep:
        use_fp8_layout(model, hf_cfg, where, stored=found)
        use_fp8_experts_layout(model, fp8_expert_layers(found, cfg))
    if not weights:
        return model.eval(), hf_cfg
    try:
        load_weights(model, found, dtype, device, block_size(hf_cfg))
    except BaseException as e:
        hf.free_partial(model, e)
        del model
        raise
    model.finish_loading(device)
    log.info("loaded %s (%d shard(s)) as %s on %s%s", path, len(files), dtype, device,
             ", fp8 projections as stored" if keep else "")
    return model.eval(), hf_cfg


class RankReader(rank_weights.RankReader):
    """A rank's slices of a DeepSeek-V3 checkpoint (rank_weights.RankReader), and its
    heads' W_UK / W_UV, split out of the kv_b_proj rows of those heads only."""

    def __init__(self, model: DeepseekV3, *args):
        super().__init__(model, *args)
        self.cfg = model.cfg
        self._absorbed: dict = {}  # (layer's attention, heads) -> (W_UK, W_UV)

    def holds(self, name: str) -> bool:
        return name.endswith(ABSORBED) or super().holds(name)

    def value(self, name: str, cut) -> torch.Tensor:
        if not name.endswith(ABSORBED):
            return super().value(name, cut)
        cfg = self.cfg
        attn, _, which = name.rpartition(".")
        heads = tuple(cut[1]) if cut is not None and cut[0] == 0 else ((0, cfg.n_heads),)
        key = (attn, heads)
        if key not in self._absorbed:  # both from one read of the heads' kv_b_proj rows
            per_head = cfg.qk_nope_head_dim + cfg.v_head_dim
            parts = [absorbed_weights(self._kv_b_rows(f"{attn}.kv_b_proj.weight", a * per_head,
                                                      b * per_head).to(self.meta[name].dtype),
                                      cfg) for a, b in heads]
            self._absorbed[key] = [torch.cat([p[i] for p in parts]) for i in range(2)]
        t = self._absorbed[key][ABSORBED.index(which)]
        if cut is not None and cut[0] != 0:  # a cut the heads do not make (none today)
            t = torch.cat([t.narrow(cut[0], a, b - a) for a, b in cut[1]], cut[0])
        return t

    def read(self, wanted: dict) -> dict[str, torch.Tensor]:
        try:
            return super().read(wanted)
        finally:
            self._absorbed.clear()

    def _kv_b_rows(self, name: str, a: int, b: int) -> torch.Tensor:
        """Rows a:b of kv_b_proj's weight as the model computes with it: an fp8 one
        dequantised from the whole blocks around them, a real one in its own dtype."""
        w = self.meta[name]
        if w.dtype != rank_weights.FP8:
            return self.real(name, (0, [(a, b)])).to(w.dtype)
        block = rank_weights.BLOCK
        lo, hi = a // block * block, min(-(-b // block) * block, w.shape[0])
        return self.real(name, (0, [(lo, hi)]))[a - lo:b - lo]


ABSORBED = ("w_uk", "w_uv")


def rank_reader(model: DeepseekV3, path, device, quantize: bool = False) -> RankReader:
    """The reader of a multi-device plan's rank for checkpoint `path`, checked against
    `model` (on the meta device: load_checkpoint(weights=False)) now, before any
    compiling; with `quantize` the model takes quantize="fp8"'s layout and each rank's
    slices are quantised as read."""
    path = Path(path)
    found = hf.read_headers(hf.weight_files(path))
    block = block_size(hf.read_json(path / "config.json"))
    mapping = tensor_map(model, found)
    check_scales(found, block)
    if any(n.endswith(SCALE_SUFFIX) for n in found) and block != (rank_weights.BLOCK,) * 2:
        raise CheckpointError(f"a multi-device load reads fp8 weights in {rank_weights.BLOCK}"
                              f"x{rank_weights.BLOCK} blocks; this checkpoint's are "
                              f"{block[0]}x{block[1]}", where=str(path / "config.json"),
                              hint="load it on one device (tensor_parallel_size=1)")
    dtype = model.lm_head.weight.dtype
    if quantize:
        use_quantized_layout(model)
    return RankReader(model, found, mapping, dtype, device)


def random_model(cfg: DeepseekV3Config, dtype: torch.dtype = torch.float32, device="cpu",
                 seed: int = 0, std: float = 0.02) -> DeepseekV3:
    """A model with random weights (normal(0, std); norms 1, biases and the router's
    score correction 0)."""
    with torch.device("meta"):
        model = DeepseekV3(cfg)
    model = hf.init_random(model, dtype, device, seed, std)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias = torch.zeros_like(
                    gate.e_score_correction_bias, dtype=torch.float32)
    model.finish_loading(device)
    return model.eval()
