"""LLM families written once, readable top to bottom, compiled by kiln.

`load(dir_or_preset, ...)` gives an LLM ready to generate: a Hugging Face checkpoint
directory (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, Qwen3-Next, DeepSeek-V3 as kiln's own
models; any other transformers causal LM through hf_recipe.py), or a preset with random
weights.
`builtin(name)` gives the models the CLI can name without a file: a model, example
args and dynamic shapes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

BUILTINS: dict[str, Callable] = {}


def _tiny_llama(**kw):
    from kiln.models.llama import example_inputs, tiny_llama

    model = tiny_llama(**kw)
    args, dynamic = example_inputs(model.cfg, seq_len=8)
    return model, args, dynamic


BUILTINS["tiny-llama"] = _tiny_llama


def builtin(name: str):
    """(model, args, dynamic_shapes) for a built-in model name, or KeyError."""
    return BUILTINS[name]()


def load(source: str | Path, *, dtype: torch.dtype | str | None = None, target=None,
         max_seq_len: int | None = None, max_batch_size: int = 1, paged: bool = False,
         block_size: int = 16, num_blocks: int | None = None,
         random_weights: bool = False, seed: int = 0, cuda_graphs: bool | None = None,
         tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
         quantize: str | None = None, keep_fp8: bool | None = None):
    """An LLM (kiln.models.generate.LLM), compiled for `target`, from `source`:

    - a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json):
      Llama 2/3/3.1, Mistral, Qwen2, Qwen3-Next (model_type "qwen3_next"), or
      DeepSeek-V3 (model_type "deepseek_v3", bf16 or fp8 weights); with
      random_weights=True only its config.json is read. Any other transformers causal
      LM (Gemma, Phi-3, OLMo, ...) loads as transformers' own model behind its
      static-cache export recipe (kiln.models.hf_recipe): one sequence at a time, a
      contiguous cache, one device, no quantize;
    - a preset name (kiln.models.llama.PRESETS: tiny, llama3-8b, llama2-70b, ...):
      random weights and a byte tokenizer;
    - a directory written by LLM.save (`kiln compile --model DIR -o ART`): loaded
      without compiling (kiln.models.saved_llm), for the target it was compiled for;
      arguments it cannot honour (another dtype, a longer context, a larger batch) are
      an ArgumentError saying how to recompile.

    target defaults to the CPU (a saved LLM: its own).

    dtype defaults to the checkpoint's (float32 for presets on the CPU, bfloat16 on a
    GPU). max_seq_len bounds the context (prompt and generated tokens); paged=True uses
    a paged KV cache of `block_size`-token blocks instead of a contiguous one.
    cuda_graphs (default: on for GPU targets) replays decode steps as CUDA graphs.

    quantize="fp8" makes the decoder projections of the Llama families, DeepSeek-V3 and
    Qwen3-Next (its full attention's and MLPs') and the routed experts of the MoE models
    block-scaled fp8 at load (kiln.models.fp8; embedding, norms, router and LM head stay
    in dtype, and so do Qwen3-Next's linear-attention projections).
    An fp8 checkpoint in Hugging Face's layout (quant_method "fp8") loads its fp8
    projections and routed experts as they are, never dequantised, when keep_fp8
    (default None: on GPU targets yes, on the CPU no). Without keep_fp8 a DeepSeek-V3
    checkpoint is dequantised into
    dtype at load; the Llama families' fp8 checkpoints always load as fp8 (keep_fp8=False
    is refused). keep_fp8=True for weights that are not fp8 is an error: quantize="fp8"
    makes them.

    tensor_parallel_size / pipeline_parallel_size > 1: a multi-device plan. Under
    torchrun this process is one rank (every rank calls load with the same arguments);
    elsewhere kiln spawns the other ranks on this machine (kiln.models.spawn) and returns
    rank 0's LLM. A checkpoint's weights are read as each rank's slices only
    (kiln.models.rank_weights), in every family; with quantize="fp8" each rank quantises
    its slices, which must hold whole 128 x 128 blocks (a tensor_parallel_size that
    cuts through one is a ShapeError naming the projection).
    """
    from kiln.errors import ArgumentError, CheckpointError, KilnError, ShapeError
    from kiln.models import hf
    from kiln.models.deepseek_v3 import DeepseekV3
    from kiln.models.fp8 import check_quantize, keeps_fp8
    from kiln.models.generate import LLM
    from kiln.models.llama import PRESETS, Llama
    from kiln.models.load_args import check_load_args
    from kiln.models.qwen3_next import Qwen3Next
    from kiln.models.saved_llm import is_saved_llm
    from kiln.models.tokenizer import ByteTokenizer, load_tokenizer
    from kiln.target import get_target

    check_load_args(source, dtype, max_seq_len, max_batch_size, block_size, num_blocks, seed,
                    tensor_parallel_size, pipeline_parallel_size)
    if is_saved_llm(source):
        return LLM.load(source, target, cuda_graphs, dtype=dtype, max_seq_len=max_seq_len,
                        max_batch_size=max_batch_size, paged=paged, quantize=quantize,
                        random_weights=random_weights,
                        tensor_parallel_size=tensor_parallel_size,
                        pipeline_parallel_size=pipeline_parallel_size)
    check_quantize(quantize)
    if quantize is not None and keep_fp8 is False:
        raise ArgumentError(f"quantize={quantize!r} makes fp8 weights; keep_fp8=False "
                            "asks for none", hint="drop one of the two")
    tgt = get_target(target)
    device = tgt.torch_device if not tgt.is_gpu or torch.cuda.is_available() else "cpu"
    parallel = ({"tp": tensor_parallel_size, "pp": pipeline_parallel_size}
                if tensor_parallel_size * pipeline_parallel_size > 1 else None)
    if parallel is not None and _by_recipe(source):
        raise ArgumentError("a checkpoint kiln has no model for runs through transformers' "
                            "static-cache recipe, on one device", where=str(source),
                            hint="drop tensor_parallel_size / pipeline_parallel_size")
    if parallel is not None:
        from kiln.models.spawn import open_world, spawn_llm, under_launcher

        if open_world() is not None:
            raise ArgumentError(
                "a multi-device LLM whose ranks this process started is still open; its "
                "ranks serve only it", where="kiln.models.load",
                hint="call .close() on that LLM first (one spawned multi-device model a "
                "process), or run each under torchrun")
        if tgt.is_gpu and torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before any weight
        if not under_launcher():
            return spawn_llm(dict(
                source=str(source), dtype=dtype, target=target, max_seq_len=max_seq_len,
                max_batch_size=max_batch_size, paged=paged, block_size=block_size,
                num_blocks=num_blocks, random_weights=random_weights, seed=seed,
                cuda_graphs=cuda_graphs, tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size, quantize=quantize,
                keep_fp8=keep_fp8),
                tensor_parallel_size * pipeline_parallel_size)
    read_weights = None
    if isinstance(dtype, str):
        if dtype not in hf.DTYPES:
            raise KilnError(f"unknown dtype {dtype!r}", hint=f"one of {', '.join(hf.DTYPES)}")
        dtype = hf.DTYPES[dtype]
    path = Path(source)
    if path.is_dir():
        config = hf.read_json(path / "config.json")
        loader = hf
        if config.get("model_type") == "deepseek_v3" or \
                "DeepseekV3ForCausalLM" in (config.get("architectures") or []):
            from kiln.models import deepseek_v3_checkpoint as loader
        elif not hf.maps(config):  # transformers' own model, through its static cache
            from kiln.models import hf_recipe as loader
        if random_weights:
            where = str(path / "config.json")
            cfg = loader.config_from_hf(config, where, max_seq_len)
            model = loader.random_model(cfg, dtype or hf.checkpoint_dtype(config)
                                        or torch.float32, device, seed)
            keep = keeps_fp8(keep_fp8, config, tgt.is_gpu, where,
                             can_dequantize=loader is not hf)
            if keep and isinstance(model, Llama | DeepseekV3):
                _quantize_fp8(model)  # random weights in the checkpoint's fp8 layout
        elif parallel:  # built on the meta device; each rank reads its slices after compiling
            model, config = loader.load_checkpoint(path, dtype, device, max_seq_len,
                                                   keep_fp8=keep_fp8, weights=False)
            read_weights = loader.rank_reader(model, path, device,
                                              quantize=quantize == "fp8").read
        else:
            model, config = loader.load_checkpoint(path, dtype, device, max_seq_len,
                                                   keep_fp8=keep_fp8)
        tokenizer = load_tokenizer(path)
        stop_ids = hf.stop_token_ids(path, config)
    elif str(source) in PRESETS:
        keeps_fp8(keep_fp8, {}, tgt.is_gpu, f"preset {source}")  # refuses True
        cfg = PRESETS[str(source)]
        if max_seq_len is not None and max_seq_len > cfg.max_seq_len:
            raise ShapeError(f"max_seq_len {max_seq_len} exceeds preset {source}'s context "
                             f"of {cfg.max_seq_len} positions", where=str(source),
                             hint=f"give max_seq_len <= {cfg.max_seq_len}")
        if max_seq_len is not None:
            cfg = cfg.with_(max_seq_len=max_seq_len)
        default = torch.float32 if tgt.name == "cpu" else torch.bfloat16
        model = hf.random_model(cfg, dtype or default, device, seed)
        tokenizer, stop_ids = ByteTokenizer(), ()
    elif path.exists() or len(path.parts) > 1:
        raise CheckpointError(f"checkpoint directory {source} does not exist",
                              where=str(source), hint="name a directory holding config.json "
                              f"and *.safetensors, or a preset ({', '.join(PRESETS)})")
    else:
        raise CheckpointError(f"{source} is neither a checkpoint directory nor a preset",
                              hint=f"presets: {', '.join(PRESETS)}")
    if quantize == "fp8":
        if not isinstance(model, Llama | DeepseekV3 | Qwen3Next):
            raise ArgumentError(f"quantize='fp8' is for the Llama families, DeepSeek-V3 "
                                f"and Qwen3-Next, not {type(model).__name__}")
        if read_weights is None:  # else each rank quantises its slices as it reads them
            _quantize_fp8(model)
    return LLM(model, tokenizer, stop_ids, target=tgt, max_batch_size=max_batch_size,
               paged=paged, block_size=block_size, num_blocks=num_blocks, name=str(source),
               cuda_graphs=cuda_graphs, parallel=parallel, read_weights=read_weights,
               checkpoint=path if path.is_dir() else None)


def _by_recipe(source) -> bool:
    """Is `source` a checkpoint directory of an architecture kiln has no model for
    (loaded by kiln.models.hf_recipe)?"""
    from kiln.models import hf

    config = Path(source) / "config.json"
    if not config.is_file():
        return False
    cfg = hf.read_json(config)
    return not hf.maps(cfg) and cfg.get("model_type") != "deepseek_v3" and \
        "DeepseekV3ForCausalLM" not in (cfg.get("architectures") or [])


def _quantize_fp8(model) -> None:
    """The decoder projections of `model` (Llama or DeepseekV3) as Fp8Linear; DeepSeek-V3's
    absorbed attention weights are derived again from its kv_b_proj's fp8 values, so
    decode's absorbed form and prefill's expanded one compute the same model."""
    from kiln.models.deepseek_v3 import DeepseekV3
    from kiln.models.fp8 import quantize_fp8

    quantize_fp8(model)
    if isinstance(model, DeepseekV3):
        model.absorb_weights()
