"""Test support: tiny random HF checkpoints (transformers' own save_pretrained), and
scripted prefill/decode runs of a kiln LLM, alone or batched."""

from __future__ import annotations

import torch

from kiln.models.kv_cache import BlockAllocator

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, kiln compiles models",
          "a cat sat on the mat and the dog sat too", "one two three four five six seven"]

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=1, eos_token_id=2)

# family -> (config class, model class, config overrides, max_shard_size)
FAMILIES = {
    # Llama 3.1 RoPE scaling; the original context is short so scaling matters here.
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM",
                 dict(rope_theta=500000.0, rope_scaling={
                     "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
                 "20KB"),  # sharded, with model.safetensors.index.json
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6), None),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True), None),
    # per-head q/k norms; head_dim not hidden_size / heads (as Qwen3-0.6B's 128 vs 64)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24), None),
}


def make_tokenizer(path) -> int:
    """Train a tiny sentencepiece-style BPE tokenizer.json into `path`; its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=96, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    return tok.get_vocab_size()


def make_checkpoint(path, family: str, seed: int = 0, **overrides):
    """Save a random tiny HF model of `family` (and a tokenizer) to `path`; the HF model."""
    import transformers

    cfg_cls, model_cls, extra, shard = FAMILIES[family]
    path.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(path)
    cfg = getattr(transformers, cfg_cls)(**{"vocab_size": vocab, **COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # HF starts biases at 0 and norms at 1: make them count too
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(str(path), **kw)
    model.generation_config.eos_token_id = None  # compare greedy runs of a fixed length
    return model


def run_alone(llm, prompt, steps):
    """Logits of a prompt's prefill (at its last token) and of `steps` decode tokens."""
    alloc = BlockAllocator(llm.cache_layout) if llm.paged else None
    n = len(prompt)

    def table(positions):
        if alloc is None:
            return None
        alloc.reserve(0, positions)
        return alloc.block_table([0])

    out = [llm.forward(prompt[None], torch.arange(n), table(n))[0, -1]]
    for j, tok in enumerate(steps):
        out.append(llm.forward(tok.view(1, 1), torch.tensor([[n + j]]), table(n + j + 1))[0, 0])
    return torch.stack(out)


def run_batched(llm, prompts, steps):
    """The same, for all prompts at once: a right-padded prefill (each row's length given
    to models that need it), then batched decode."""
    alloc = BlockAllocator(llm.cache_layout) if llm.paged else None
    lens = [len(p) for p in prompts]
    T = max(lens)
    tokens = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p

    def table(positions, width=None):
        if alloc is None:
            return None
        for i, n in enumerate(positions):
            alloc.reserve(i, n)
        return alloc.block_table(list(range(len(prompts))), width)

    width = -(-T // llm.cache_layout.block_size) if llm.paged else None
    # a model with recurrent state (Qwen3-Next) must not advance it through the padding
    seq_lens = torch.tensor(lens) if llm.needs_seq_lens else None
    logits = llm.forward(tokens, torch.arange(T), table(lens, width), seq_lens=seq_lens)
    out = [[logits[i, n - 1]] for i, n in enumerate(lens)]
    for j in range(steps.shape[1]):
        pos = torch.tensor([[n + j] for n in lens])
        step = llm.forward(steps[:, j:j + 1], pos, table([n + j + 1 for n in lens]))
        for i in range(len(prompts)):
            out[i].append(step[i, 0])
    return [torch.stack(o) for o in out]
