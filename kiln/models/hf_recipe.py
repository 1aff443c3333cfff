"""Checkpoints of causal LMs kiln has no model for: transformers' own model, decoded
through transformers' static-cache export recipe, compiled by kiln for generation.

Why: kiln.models maps the Llama families, Qwen3-Next and DeepSeek-V3 onto its own
modules; any other Hugging Face checkpoint directory (Gemma, Phi-3, OLMo, ...) was
refused by `kiln generate` and kiln.models.load although kiln.compile runs those models
as they are written (README, "Models kiln does not know"). Here the checkpoint loads
with transformers (AutoModelForCausalLM), is wrapped in
TorchExportableModuleWithStaticCache (a static KV cache that torch.export keeps as
state), and RecipeLM gives that wrapper the interface kiln.models.generate.LLM compiles
and drives: forward(tokens, input_pos, logits_at) and setup_cache.

What the recipe fixes: one sequence at a time (its cache has one row), a contiguous
cache (no paging), one device, the checkpoint's own weights (no fp8 quantisation at
load). Each of these, asked for, is an ArgumentError naming it. transformers must be
installed (it is kiln's reference, not its dependency).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import torch.nn as nn

from kiln.errors import ArgumentError, CheckpointError
from kiln.models.hf import checkpoint_dtype, context_length, read_json

log = logging.getLogger("kiln.models")


@dataclasses.dataclass(frozen=True)
class RecipeConfig:
    """What LLM reads of a model's config: its context and vocabulary, and the
    architecture transformers builds."""

    architecture: str
    vocab_size: int
    max_seq_len: int
    hf: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def refill_at(self) -> int | None:
        """The position at which transformers' generate recomputes a longrope model's
        whole cache (Phi-3.5, Phi-4-mini, PhiMoE: prepare_inputs_for_generation, the
        first time the sequence passes original_max_position_embeddings, so every key is
        rotated by the long factors from then on); LLM.generate prefills again there.
        None for other models."""
        text = text_fields(self.hf)
        rope = text.get("rope_parameters") or text.get("rope_scaling")
        if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type")) != "longrope":
            return None
        at = text.get("original_max_position_embeddings") or \
            rope.get("original_max_position_embeddings")
        return at if isinstance(at, int) and not isinstance(at, bool) and at > 0 else None


def transformers_class(hf_cfg: dict, where: str):
    """The transformers causal-LM class config.json's architectures names, or a
    CheckpointError saying what kiln loads."""
    archs = hf_cfg.get("architectures") or []
    arch = archs[0] if archs else None
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        raise CheckpointError(
            f"architecture {arch or hf_cfg.get('model_type')!r} has no kiln model, and "
            "transformers (which would run it through its static-cache recipe) is not "
            "installed", where=where, hint="pip install transformers, or load a Llama, "
            "Mistral, Qwen2/3, Qwen3-Next or DeepSeek-V3 checkpoint") from None
    if arch is None:  # a config.json without architectures: its model_type's causal LM
        named = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_cfg.get("model_type"))
        arch = named if isinstance(named, str) else (named or [None])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if cls is None or arch not in _causal_lm_names():
        raise CheckpointError(
            f"architecture {arch or hf_cfg.get('model_type')!r} is neither a kiln model "
            f"nor a transformers causal LM (transformers {transformers.__version__})",
            where=where, hint="kiln generates with the causal LMs AutoModelForCausalLM "
            "builds; compile other models with kiln.compile")
    return cls


def _causal_lm_names() -> set[str]:
    """The classes transformers' AutoModelForCausalLM builds (GPT2LMHeadModel among them)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set()
    for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([v] if isinstance(v, str) else v)
    return names


def text_fields(hf_cfg: dict) -> dict:
    """The config's language-model fields: a multimodal checkpoint (Gemma 3's
    Gemma3ForConditionalGeneration, Mistral 3, ...) keeps its vocabulary and context
    in `text_config`, beside the vision tower's."""
    text = hf_cfg.get("text_config")
    if not isinstance(text, dict):
        return hf_cfg
    return {**{k: v for k, v in text.items() if v is not None},
            **{k: v for k, v in hf_cfg.items() if k != "text_config" and v is not None}}


def config_from_hf(hf_cfg: dict, where: str = "config.json",
                   max_seq_len: int | None = None) -> RecipeConfig:
    cls = transformers_class(hf_cfg, where)
    text = text_fields(hf_cfg)
    vocab = text.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
        raise CheckpointError(f"vocab_size {vocab!r} is not a positive int", where=where)
    if (hf_cfg.get("quantization_config") or {}).get("quant_method"):
        raise CheckpointError(
            f"a quantized {cls.__name__} checkpoint "
            f"({hf_cfg['quantization_config']['quant_method']}) has no kiln model",
            where=where, hint="kiln loads quantized checkpoints of the Llama families and "
            "DeepSeek-V3; give this model's bf16 / fp16 weights")
    return RecipeConfig(cls.__name__, vocab, context_length(text, where, max_seq_len),
                        dict(hf_cfg))


class HeadAtRows(nn.Module):
    """The model's LM head, applied only at the prompt rows LLM asks logits of (`rows`,
    [1, L] indices into T, set around a prefill call) when they are set: a prefill of T
    tokens then projects L rows, not T (a 4096-token prompt of a 256k-vocabulary model
    would otherwise make a [4096, 256k] logits tensor to keep one row of it)."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head
        self.rows: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            h = h[:, self.rows[0]]
        return self.head(h)


class RecipeLM(nn.Module):
    """transformers' causal LM behind its static-cache recipe, with LLM's interface."""

    needs_seq_lens = False

    def __init__(self, hf_model: nn.Module, cfg: RecipeConfig):
        super().__init__()
        self.hf = hf_model
        self.cfg = cfg
        self.recipe = None  # setup_cache makes it (its cache sits beside the weights)
        self.head_at_rows = None  # setup_cache: a HeadAtRows the model's forward calls


    @property
    def lm_head(self) -> nn.Module:
        return self.hf.get_output_embeddings()

    def init_rope(self, device) -> None:
        """transformers computes its own position tables."""

    def setup_cache(self, dtype: torch.dtype | None = None, *, max_batch_size: int = 1,
                    paged: bool = False, block_size: int = 16,
                    num_blocks: int | None = None) -> None:
        from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

        if max_batch_size != 1 or paged:
            raise ArgumentError(
                f"{self.cfg.architecture} runs through transformers' static-cache recipe: "
                "one sequence at a time in a contiguous cache",
                where="kiln.models.load", hint="drop max_batch_size / paged (--max-batch-"
                "size, --cache paged) for this model")
        device = next(self.hf.parameters()).device
        self.hf.generation_config.cache_implementation = "static"
        self.hf.requires_grad_(False)
        self.recipe = TorchExportableModuleWithStaticCache(
            self.hf, batch_size=1, max_cache_len=self.cfg.max_seq_len, device=device)
        for b in self.recipe.buffers():  # the cache: state, never a graph leaf
            b.requires_grad_(False)
        self._head_at_rows(device)

    def _head_at_rows(self, device) -> None:
        """Put HeadAtRows in place of the output embedding where the model's forward
        calls it (one eager 2-token step says so: its logits keep 1 row); elsewhere
        forward gathers the rows from every row's logits. The step writes cache
        positions 0 and 1, which a prefill writes again before any step reads them."""
        head = self.hf.get_output_embeddings()
        if head is None or not hasattr(self.hf, "set_output_embeddings"):
            return
        wrapper = HeadAtRows(head)
        self.hf.set_output_embeddings(wrapper)
        wrapper.rows = torch.ones(1, 1, dtype=torch.long, device=device)
        try:
            with torch.no_grad():
                out = self.recipe(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device),
                                  cache_position=torch.arange(2, device=device))
        except Exception:  # noqa: BLE001 - a model the recipe cannot run: export says why
            out = None
        finally:
            wrapper.rows = None
        if out is not None and out.shape[1] == 1:
            self.head_at_rows = wrapper
        else:
            self.hf.set_output_embeddings(head)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [1, T, vocab] of tokens [1, T] at positions input_pos [1, T] (or only
        at logits_at [1, L], indices into T), the cache written at those positions."""
        if logits_at is None:
            return self.recipe(input_ids=tokens, cache_position=input_pos[0])
        if self.head_at_rows is None:
            logits = self.recipe(input_ids=tokens, cache_position=input_pos[0])
            return logits.gather(1, logits_at[..., None].expand(-1, -1, logits.shape[-1]))
        self.head_at_rows.rows = logits_at
        try:
            return self.recipe(input_ids=tokens, cache_position=input_pos[0])
        finally:
            self.head_at_rows.rows = None


def _built(cls, hf_cfg: dict, dtype: torch.dtype, device, path: Path | None) -> nn.Module:
    """The transformers model, SDPA attention where the family has it (else eager)."""
    config_cls = cls.config_class
    kw = {k: v for k, v in hf_cfg.items() if k not in ("architectures", "model_type")}
    config = config_cls(**kw)
    for attn in ("sdpa", "eager"):
        config._attn_implementation = attn
        try:
            if path is None:
                model = cls(config)
            else:
                model = cls.from_pretrained(path, config=config, dtype=dtype)
            break
        except ValueError as e:  # Gemma 2, BLOOM, GPT-OSS: eager attention only
            if "attention" not in str(e) or attn == "eager":
                raise
    return model.to(device=device, dtype=dtype).eval()


def load_checkpoint(path, dtype: torch.dtype | None = None, device="cpu",
                    max_seq_len: int | None = None, weights: bool = True,
                    keep_fp8: bool | None = None) -> tuple[RecipeLM, dict]:
    """(RecipeLM, config.json) for a checkpoint directory transformers loads."""
    path = Path(path)
    where = str(path / "config.json")
    hf_cfg = read_json(path / "config.json")
    cfg = config_from_hf(hf_cfg, where, max_seq_len)
    if not weights:
        raise ArgumentError(f"{cfg.architecture} loads on one device only",
                            hint="drop tensor_parallel_size / pipeline_parallel_size")
    if keep_fp8:
        raise ArgumentError(f"keep_fp8 is for fp8 checkpoints; {cfg.architecture}'s has none")
    import transformers

    dtype = dtype or checkpoint_dtype(hf_cfg) or torch.float32
    try:
        model = _built(getattr(transformers, cfg.architecture), hf_cfg, dtype, device, path)
    except (OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"transformers could not load {cfg.architecture} from {path}: "
                              f"{e}", where=str(path)) from None
    log.info("loaded %s as transformers' %s (static-cache recipe), %s on %s", path,
             cfg.architecture, dtype, device)
    return RecipeLM(model, cfg), hf_cfg


def random_model(cfg: RecipeConfig, dtype: torch.dtype = torch.float32, device="cpu",
                 seed: int = 0) -> RecipeLM:
    """transformers' model of config.json with its own random initialisation (seeded)."""
    import transformers

    torch.manual_seed(seed)
    model = _built(getattr(transformers, cfg.architecture), cfg.hf, dtype, device, None)
    return RecipeLM(model, cfg)
