"""A compiled LLM on disk: LLM.save(DIR) writes it, kiln.models.load(DIR) (and `kiln
generate DIR`) reads it back in seconds, with no export, no passes and no tuning.

    llama.kiln/
      llm.json             {"format": "kiln-llm", "format_version": 1, ...}: the model's
                           config, target, dtype, batch size, cache layout, stop ids,
                           which tokenizer
      modules.json         kiln.save_modules: the prefill and decode modules, their
      weights.safetensors  weights stored once (both read the same tensors), the KV
      prefill/ decode/     caches as shapes only (they start as zeros)
      tokenizer.json ...   the checkpoint's tokenizer, config.json and
                           generation_config.json, copied as they were

Everything that can be checked is checked before any weight is read: the format
version, the target against this machine, the other load arguments against what was
compiled; each mismatch is a KilnError saying how to recompile.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

import kiln
from kiln.errors import ArgumentError, ArtifactError
from kiln.models.deepseek_v3 import DeepseekV3Config
from kiln.models.hf_recipe import RecipeConfig
from kiln.models.kv_cache import PagedLayout
from kiln.models.llama import LlamaConfig
from kiln.models.qwen3_next import Qwen3NextConfig
from kiln.models.tokenizer import ByteTokenizer, load_tokenizer
from kiln.target import get_target

LLM_FILE = "llm.json"
FORMAT = "kiln-llm"
FORMAT_VERSION = 1
# copied from the checkpoint when present: what transformers and people look for
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                    "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
CONFIGS = {c.__name__: c for c in (LlamaConfig, Qwen3NextConfig, DeepseekV3Config,
                                    RecipeConfig)}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _recompile(path, flag: str = "", source: str = "CHECKPOINT") -> str:
    return f"compile it again: kiln compile --model {source} -o {path}{flag}"


def is_saved_llm(path) -> bool:
    """A directory written by LLM.save (or what is left of one)."""
    p = Path(path)
    return p.is_dir() and ((p / LLM_FILE).is_file() or (p / "modules.json").is_file())


# ---- saving ----------------------------------------------------------------------------


def save_llm(llm, path) -> None:
    """Write `llm` (a kiln.models.generate.LLM) to the directory `path`."""
    if llm.parallel:
        raise ArgumentError("a multi-device LLM cannot be saved yet",
                            hint="save an LLM loaded on one device")
    if type(llm.cfg).__name__ not in CONFIGS:
        raise ArgumentError(f"an LLM of {type(llm.cfg).__name__} cannot be saved",
                            hint=f"kiln saves {', '.join(CONFIGS)} models")
    files: dict[str, str | Path] = {}
    source = Path(llm.checkpoint) if llm.checkpoint else None
    for name in CHECKPOINT_FILES:
        if source is not None and (source / name).is_file():
            files[name] = source / name
    tokenizer = None
    if isinstance(llm.tokenizer, ByteTokenizer):
        tokenizer = "bytes"
    elif llm.tokenizer is not None:
        files["tokenizer.json"] = Path(llm.tokenizer.path)
        tokenizer = "tokenizer.json"
    layout = llm.cache_layout
    cache = {"kind": "contiguous"} if layout is None else \
        {"kind": "paged", **dataclasses.asdict(layout)}
    body = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kiln": kiln.__version__,
        "name": llm.name, "target": llm.target.name,
        "dtype": str(llm.dtype).removeprefix("torch."),
        "config": {"class": type(llm.cfg).__name__, **_config_json(llm.cfg)},
        "max_batch_size": llm.max_batch_size,
        "cache": cache,
        "needs_seq_lens": llm.needs_seq_lens, "cuda_graphs": llm.cuda_graphs,
        "stop_ids": sorted(llm.stop_ids), "tokenizer": tokenizer,
    }
    files[LLM_FILE] = json.dumps(body, indent=1) + "\n"
    modules = {"prefill": llm.prefill_module, "decode": llm.decode_module}
    kiln.save_modules(path, modules, empty_state=True, files=files)


def _config_json(cfg) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}


def _config_from_json(j: dict, where: str, hint: str):
    j = dict(j)
    cls = CONFIGS.get(j.pop("class", None))
    if cls is None:
        raise ArtifactError(f"{where} names no model config kiln knows "
                            f"({', '.join(CONFIGS)})", hint=hint)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.init and f.name in j:
            v = j[f.name]
            kw[f.name] = tuple(v) if isinstance(v, list) and "tuple" in str(f.type) else v
    try:
        return cls(**kw)
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"{where} holds a {cls.__name__} kiln cannot build: {e}",
                            hint=hint) from None


# ---- loading ---------------------------------------------------------------------------


@dataclass
class SavedLLM:
    """What LLM.load needs from a saved directory, every part checked and loaded."""

    prefill: kiln.CompiledModule
    decode: kiln.CompiledModule
    cfg: object
    tokenizer: object
    stop_ids: list[int]
    target: kiln.Target
    dtype: torch.dtype
    max_batch_size: int
    cache_layout: PagedLayout | None
    needs_seq_lens: bool
    cuda_graphs: bool
    name: str


def read_manifest(path: Path) -> dict:
    f = path / LLM_FILE
    if not f.is_file():
        raise ArtifactError(f"{path} is not a saved kiln LLM: it has no {LLM_FILE}",
                            hint=_recompile(path))
    try:
        body = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"cannot read {f}: {e}", hint="the file is corrupt; "
                            + _recompile(path)) from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ArtifactError(f"{f} is not a kiln LLM manifest", hint=_recompile(path))
    if body.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{f} has format version {body.get('format_version')} (written "
                            f"by kiln {body.get('kiln', '?')}); this kiln reads version "
                            f"{FORMAT_VERSION}", hint=_recompile(path) + " with this kiln")
    return body


def read_saved_llm(path, target=None, asked: dict | None = None) -> SavedLLM:
    """The saved LLM at `path`; `target` and `asked` (kiln.models.load's other arguments)
    are checked against it before any weight is read."""
    path = Path(path)
    body = read_manifest(path)
    where = str(path / LLM_FILE)
    try:
        source = str(body.get("name") or "CHECKPOINT")
        tgt = _check_target(path, body["target"], target, source)
        dtype = DTYPES[body["dtype"]]
        cfg = _config_from_json(body["config"], where, _recompile(path, "", source))
        cache = body["cache"]
        layout = None if cache["kind"] == "contiguous" else PagedLayout(
            int(cache["block_size"]), int(cache["blocks_per_seq"]), int(cache["num_blocks"]))
        max_batch = int(body["max_batch_size"])
        _check_asked(path, asked or {}, dtype, cfg.max_seq_len, max_batch, layout, source)
        tokenizer = _tokenizer(path, body.get("tokenizer"))
        fields = (list(map(int, body["stop_ids"])), bool(body["needs_seq_lens"]),
                  bool(body["cuda_graphs"]), source)
    except (KeyError, TypeError, ValueError) as e:
        detail = f"missing entry {e}" if isinstance(e, KeyError) else str(e)
        raise ArtifactError(f"{where} is not a valid kiln LLM manifest: {detail}",
                            hint=_recompile(path)) from None
    modules = kiln.load_modules(path, tgt)
    missing = {"prefill", "decode"} - set(modules)
    if missing:
        raise ArtifactError(f"{path} lacks the {', '.join(sorted(missing))} module",
                            hint=_recompile(path))
    stop_ids, needs_seq_lens, cuda_graphs, name = fields
    return SavedLLM(modules["prefill"], modules["decode"], cfg, tokenizer, stop_ids, tgt,
                    dtype, max_batch, layout, needs_seq_lens, cuda_graphs, name)


def _check_target(path: Path, saved: str, requested, source: str) -> kiln.Target:
    """The target the LLM was compiled for, if this machine can run it."""
    tgt = get_target(saved)
    if requested is not None:
        asked = get_target(requested)
        if asked.name != tgt.name:
            raise ArtifactError(f"{path} was compiled for {tgt.name}, not {asked.name}",
                                hint=f"load it with no target (or {tgt.name}), or "
                                + _recompile(path, f" --target {asked.name}", source))
    if tgt.is_gpu:
        if not torch.cuda.is_available():
            raise ArtifactError(f"{path} was compiled for {tgt.name}, and this machine "
                                "has no GPU", hint="generate on a machine with that GPU, "
                                "or " + _recompile(path, " --target cpu", source))
        here = get_target("cuda")
        if here.name != tgt.name:
            raise ArtifactError(f"{path} was compiled for {tgt.name}; this GPU is "
                                f"{here.name}", hint=_recompile(path, " --target cuda", source))
    return tgt


def _check_asked(path: Path, asked: dict, dtype, max_seq_len: int, max_batch: int,
                 layout, source: str) -> None:
    """Load arguments a compiled LLM cannot honour: each an ArgumentError saying how."""
    def wrong(what: str, flag: str):
        raise ArgumentError(f"{path} was compiled {what}", hint=_recompile(path, flag, source))

    want = asked.get("dtype")
    want = str(want).removeprefix("torch.") if want is not None else None
    have = str(dtype).removeprefix("torch.")
    if want is not None and want != have:
        wrong(f"for {have}, not {want}", f" --dtype {want}")
    if asked.get("max_seq_len") not in (None, max_seq_len):
        wrong(f"for a context of {max_seq_len} tokens, not {asked['max_seq_len']}",
              f" --max-seq-len {asked['max_seq_len']}")
    if asked.get("max_batch_size", 1) > max_batch:
        wrong(f"for batches of up to {max_batch}, not {asked['max_batch_size']}",
              f" --max-batch-size {asked['max_batch_size']}")
    if asked.get("paged") and layout is None:
        wrong("with the contiguous KV cache, not the paged one", " --cache paged")
    if asked.get("quantize") is not None:
        wrong("already: quantization is chosen when compiling",
              f" --quantize {asked['quantize']}")
    if asked.get("random_weights"):
        wrong("with the weights it holds", " --random-weights")
    if asked.get("tensor_parallel_size", 1) * asked.get("pipeline_parallel_size", 1) > 1:
        raise ArgumentError(f"{path} is a compiled single-device LLM",
                            hint="load the checkpoint itself with tensor or pipeline "
                            "parallelism")


def _tokenizer(path: Path, saved):
    if saved == "bytes":
        return ByteTokenizer()
    if (path / "tokenizer.json").is_file():  # also one copied in by hand later
        return load_tokenizer(path)
    if saved is not None:
        raise ArtifactError(f"{path} has no tokenizer.json, which {LLM_FILE} names",
                            hint="copy the model's tokenizer.json into it, or "
                            + _recompile(path))
    return None
