"""Encoder-style models people hand to kiln.compile (BERT family, T5 / BART encoders,
ViT, CLIP, Whisper's encoder, Wav2Vec2, GPT-2 without a cache, mean-pooled sentence
embeddings, sequence classifiers): tiny random configs, fp32, eval, a padded
attention mask and a dynamic length where the model allows one; each compiled, run on
its example and on fresh inputs of another length, compared with eager.

    PYTHONPATH=. python benchmarks/zoo_encoders.py [--target cpu|interpret]
        [--only bert,vit] [--save-load bert] [--attn eager] [--lengths 9,13]
        [--left-pad] [--dyn-batch]

--attn eager: transformers' own softmax(q k^T + mask) v instead of SDPA; --lengths: the
example's length then the fresh ones (max 120); --left-pad: the padding before the
tokens; --dyn-batch: the batch dynamic too (text models: 2, then 3 and 1 in turn).

One line per model: matched (worst relative error over every output tensor and both
calls), refused (a KilnError: its first line), export (torch.export failed) or FAILED
(a wrong result or any other exception: a kiln bug); for a GPU target on a machine
without one, compiled (compile-only: every kernel generated and built, none run).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import traceback
import warnings

import torch
import transformers as tf
from torch import nn
from torch.utils._pytree import tree_leaves

import kiln
from kiln.errors import ExportError, KilnError, KilnWarning

TOL = 1e-5
B = 2
# the example's length, then fresh ones; at 1-3 the padded row is all padding
LENGTHS = (9, 13, 1)
SEQ = kiln.Dim("seq", min=1, max=120)
BATCH = kiln.Dim("batch", min=1, max=8)
TXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           vocab_size=100, max_position_embeddings=128)
OPTS = {"attn": None, "left_pad": False, "dyn_batch": False, "batch": B}


def _ids_mask(t: int, pad_id: int = 0) -> dict:
    """input_ids with the second row's last 3 tokens padding (first 3 with --left-pad),
    and its attention mask."""
    b = OPTS["batch"]
    ids = torch.randint(3, 100, (b, t))
    mask = torch.ones(b, t, dtype=torch.long)
    pad = slice(0, 3) if OPTS["left_pad"] else slice(-3, None)
    mask[b - 1, pad] = 0
    ids[b - 1, pad] = pad_id
    return {"input_ids": ids, "attention_mask": mask}


def _text_dyn(kw: dict) -> dict:
    dims = {0: BATCH, 1: SEQ} if OPTS["dyn_batch"] else {1: SEQ}
    return {k: (dims if isinstance(v, torch.Tensor) else None) for k, v in kw.items()}


class MeanPooled(nn.Module):
    """A sentence-transformers style embedding: the encoder's states averaged over the
    mask, L2-normalised."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask)[0]
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return nn.functional.normalize(pooled, p=2, dim=1)


def _text(cls, cfg, pad_id=0, wrap=None, **extra):
    def make():
        torch.manual_seed(0)
        m = cls(cfg).eval()
        m = wrap(m) if wrap else m
        return m, lambda t: {**_ids_mask(t, pad_id), **extra}, _text_dyn
    return make


def _t5_encoder():
    cfg = tf.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=100,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16)
    return _text(tf.T5EncoderModel, cfg)()


def _bart_encoder():
    cfg = tf.BartConfig(d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100,
                        max_position_embeddings=128, pad_token_id=1)
    torch.manual_seed(0)
    enc = tf.BartModel(cfg).eval().get_encoder()
    return enc, lambda t: _ids_mask(t, 1), _text_dyn


def _vision(cls, cfg, size=32):
    def make():
        torch.manual_seed(0)
        m = cls(cfg).eval()
        batch = kiln.Dim("batch", min=1, max=8)
        return (m, lambda t: {"pixel_values": torch.randn(t, 3, size, size)},
                lambda kw: {"pixel_values": {0: batch}})
    return make


def _whisper_encoder():
    cfg = tf.WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100,
                           num_mel_bins=16, max_source_positions=16, max_target_positions=32,
                           pad_token_id=0, bos_token_id=0, eos_token_id=0,
                           decoder_start_token_id=0)
    torch.manual_seed(0)
    enc = tf.WhisperModel(cfg).eval().get_encoder()
    batch = kiln.Dim("batch", min=1, max=8)
    return (enc, lambda t: {"input_features": torch.randn(t, 16, 32)},
            lambda kw: {"input_features": {0: batch}})


def _wav2vec2():
    cfg = tf.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                            conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                            num_conv_pos_embedding_groups=4, vocab_size=32)
    torch.manual_seed(0)
    m = tf.Wav2Vec2Model(cfg).eval()
    # a plain Dim is refused by torch.export (its guards need the length // 10 exact);
    # its suggested fix, a derived Dim:
    samples = 10 * kiln.Dim("tenths", min=20, max=200)

    def inputs(t):
        n = 200 + 40 * t
        mask = torch.ones(B, n, dtype=torch.long)
        mask[1, -37:] = 0
        return {"input_values": torch.randn(B, n), "attention_mask": mask}
    return m, inputs, lambda kw: {k: {1: samples} for k in kw}


def _clip_text():
    cfg = tf.CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, vocab_size=100, max_position_embeddings=128,
                            projection_dim=16, eos_token_id=2)
    return _text(tf.CLIPTextModel, cfg)()


CASES = {
    "bert": _text(tf.BertModel, tf.BertConfig(**TXT)),
    "roberta": _text(tf.RobertaModel, tf.RobertaConfig(**TXT), pad_id=1),
    "distilbert": _text(tf.DistilBertModel, tf.DistilBertConfig(
        dim=32, hidden_dim=64, n_layers=2, n_heads=4, vocab_size=100,
        max_position_embeddings=128)),
    "albert": _text(tf.AlbertModel, tf.AlbertConfig(embedding_size=16, **TXT)),
    "electra": _text(tf.ElectraModel, tf.ElectraConfig(embedding_size=16, **TXT)),
    "deberta_v2": _text(tf.DebertaV2Model, tf.DebertaV2Config(
        relative_attention=True, position_buckets=8, max_relative_positions=16,
        pos_att_type=["p2c", "c2p"], **TXT)),
    "xlm_roberta": _text(tf.XLMRobertaModel, tf.XLMRobertaConfig(**TXT), pad_id=1),
    "mpnet": _text(tf.MPNetModel, tf.MPNetConfig(**TXT), pad_id=1),
    "t5_encoder": _t5_encoder,
    "bart_encoder": _bart_encoder,
    "gpt2_no_cache": _text(tf.GPT2Model, tf.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=128), use_cache=False),
    "clip_text": _clip_text,
    "vit": _vision(tf.ViTModel, tf.ViTConfig(
        image_size=32, patch_size=8, **{k: v for k, v in TXT.items()
                                        if k not in ("vocab_size", "max_position_embeddings")})),
    "clip_vision": _vision(tf.CLIPVisionModel, tf.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=32, patch_size=8, projection_dim=16)),
    "whisper_encoder": _whisper_encoder,
    "wav2vec2": _wav2vec2,
    "bert_mean_pooled": _text(tf.BertModel, tf.BertConfig(**TXT), wrap=MeanPooled),
    "mpnet_mean_pooled": _text(tf.MPNetModel, tf.MPNetConfig(**TXT), pad_id=1,
                               wrap=MeanPooled),
    "bert_seq_cls": _text(tf.BertForSequenceClassification,
                          tf.BertConfig(num_labels=3, **TXT)),
    "roberta_seq_cls": _text(tf.RobertaForSequenceClassification,
                             tf.RobertaConfig(num_labels=3, **TXT), pad_id=1),
    "gpt2_seq_cls": _text(tf.GPT2ForSequenceClassification, tf.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=128, pad_token_id=0,
        num_labels=3), use_cache=False),
    "deberta_v2_seq_cls": _text(tf.DebertaV2ForSequenceClassification, tf.DebertaV2Config(
        num_labels=3, relative_attention=True, position_buckets=8, max_relative_positions=16,
        pos_att_type=["p2c", "c2p"], **TXT)),
}
VISION = {"vit", "clip_vision", "whisper_encoder"}  # their dynamic dim is the batch


def _worst(out, ref) -> float:
    """The worst relative error over the output tensors (their structure must agree)."""
    got = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    want = [t for t in tree_leaves(ref) if isinstance(t, torch.Tensor)]
    if len(got) != len(want):
        raise AssertionError(f"{len(got)} output tensors, eager has {len(want)}")
    errs = []
    for a, b in zip(got, want):
        if a.shape != b.shape:
            raise AssertionError(f"output shape {tuple(a.shape)}, eager {tuple(b.shape)}")
        a, b = a.double(), b.double()
        errs.append(((a - b).norm() / b.norm().clamp(min=1e-30)).item())
    return max(errs)


def run_case(name: str, target: str, save_load: bool) -> tuple[str, str]:
    """(result, detail) of one model."""
    model, make, dyn = CASES[name]()
    if OPTS["attn"]:
        next(m for m in model.modules() if hasattr(m, "set_attn_implementation")) \
            .set_attn_implementation(OPTS["attn"])
    sizes = (2, 3, 1) if name in VISION else LENGTHS
    torch.manual_seed(1)
    kw = make(sizes[0])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KilnWarning)
            exe = kiln.compile(model, (), kw, dynamic_shapes=dyn(kw), target=target)
            if save_load:
                with tempfile.TemporaryDirectory() as d:
                    exe.save(os.path.join(d, "m.kiln"))
                    exe = kiln.load(os.path.join(d, "m.kiln"))
    except ExportError as e:
        return "export", str(e).splitlines()[0]
    except KilnError as e:
        return "refused", str(e).splitlines()[0]
    except Exception as e:  # noqa: BLE001 - a raw exception is a kiln bug: report it
        traceback.print_exc()
        return "FAILED", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if target.startswith("cuda") and not torch.cuda.is_available():
        return "compiled", "compile-only: no GPU here"
    worst, kept = 0.0, []
    try:
        for i, t in enumerate(sizes):
            if i and OPTS["dyn_batch"] and name not in VISION:
                OPTS["batch"] = (3, 1)[i % 2]
            args = kw if i == 0 else make(t)
            with torch.no_grad():
                out, ref = exe(**args), model(**args)
            worst = max(worst, _worst(out, ref))
            kept.append((out, ref))
        # an earlier call's outputs must survive the later calls
        worst = max(worst, *(_worst(out, ref) for out, ref in kept))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        return "FAILED", f"run: {type(e).__name__}: {str(e).splitlines()[0]}"
    return ("matched" if worst < TOL else "FAILED"), f"{worst:.1e}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="cpu")
    p.add_argument("--only", default="", help="comma-separated model names")
    p.add_argument("--save-load", default="", help="models to save and load before running")
    p.add_argument("--attn", default=None, help="attn_implementation (eager, sdpa)")
    p.add_argument("--lengths", default="", help="example length, then fresh ones")
    p.add_argument("--left-pad", action="store_true")
    p.add_argument("--dyn-batch", action="store_true")
    args = p.parse_args()
    global LENGTHS
    if args.lengths:
        LENGTHS = tuple(int(x) for x in args.lengths.split(","))
    OPTS.update(attn=args.attn, left_pad=args.left_pad, dyn_batch=args.dyn_batch)
    names = args.only.split(",") if args.only else list(CASES)
    saved = set(args.save_load.split(",")) if args.save_load else set()
    print(f"{'model':22}{'target':>10}  {'result':8} {'s':>6}  rel err / error", flush=True)
    counts: dict[str, int] = {}
    for name in names:
        t0 = time.perf_counter()
        OPTS["batch"] = B
        result, detail = run_case(name, args.target, name in saved)
        counts[result] = counts.get(result, 0) + 1
        tag = args.target + ("+save" if name in saved else "")
        print(f"{name:22}{tag:>10}  {result:8} {time.perf_counter() - t0:6.1f}  {detail}",
              flush=True)
    print(", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
