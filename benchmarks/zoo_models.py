"""Models people bring that are not causal LMs, tiny and random: HF vision, audio,
seq2seq, encoder, detection, depth, speech and multimodal models (the fourth and fifth
architecture sweeps, and the sixth's encoders, seq2seq, time-series, audio and vision
models, tests/fuzz/FINDINGS.md). MODELS: name -> (build the model, make its
keyword inputs); benchmarks/zoo_gpu.py runs them as its `models` set on any target.
"""

from __future__ import annotations

import torch
import transformers as tf

ENC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
SEQ2SEQ = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
               vocab_size=100, max_position_embeddings=64)
AUDIO = dict(ENC, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
             num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)
STAGES = dict(hidden_sizes=[16, 32], depths=[1, 1])
SWIN = dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
            window_size=4)
VIT = dict(ENC, image_size=32, patch_size=8)


def image(size=32):
    return lambda: {"pixel_values": torch.randn(2, 3, size, size)}


def ids(t=9, vocab=100, **extra):
    return lambda: {"input_ids": torch.randint(3, vocab, (2, t)), **extra}


def seq2seq():
    return {"input_ids": torch.randint(3, 100, (2, 9)),
            "decoder_input_ids": torch.randint(3, 100, (2, 5)), "use_cache": False}


def audio():
    return {"input_values": torch.randn(2, 800)}


def llava():
    vision = tf.CLIPVisionConfig(image_size=16, patch_size=8, **ENC)
    text = tf.LlamaConfig(vocab_size=120, num_key_value_heads=1, max_position_embeddings=64,
                          **ENC)
    return tf.LlavaForConditionalGeneration(tf.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=110, vision_feature_layer=-1))


def llava_inputs():
    tokens = torch.randint(0, 100, (2, 12))
    tokens[:, 2:6] = 110  # four image tokens a row: one 16 x 16 image of 4 patches
    return {"input_ids": tokens, "pixel_values": torch.randn(2, 3, 16, 16), "use_cache": False}


def qwen2_vl():
    text = dict(vocab_size=160, num_key_value_heads=1, **ENC,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, in_channels=3,
                  patch_size=2, spatial_merge_size=2, temporal_patch_size=2)
    return tf.Qwen2VLForConditionalGeneration(tf.Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=150, video_token_id=151,
        vision_start_token_id=152))


T5ISH = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=100,
             decoder_start_token_id=0)
TS = dict(prediction_length=4, context_length=8, lags_sequence=[1, 2], input_size=1,
          num_time_features=1, d_model=16, encoder_layers=1, decoder_layers=1,
          encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
          decoder_ffn_dim=32)


def masked_seq2seq():
    """With the attention mask a tokenizer gives: traced, transformers' T5 variants do not
    make one (LongT5, SwitchTransformers fail without it)."""
    return {**seq2seq(), "attention_mask": torch.ones(2, 9, dtype=torch.int64)}


def ts_inputs():
    past = 8 + 2  # context + max lag
    return {"past_values": torch.randn(2, past), "past_time_features": torch.randn(2, past, 1),
            "past_observed_mask": torch.ones(2, past),
            "future_time_features": torch.randn(2, 4, 1), "use_cache": False}


def pix2struct_patches():
    """16 patches of 16 x 16 x 3 values, each row led by its 1-based (row, col)."""
    grid = torch.stack(torch.meshgrid(torch.arange(1, 5), torch.arange(1, 5), indexing="ij"), -1)
    coords = grid.reshape(1, 16, 2).expand(2, -1, -1).float()
    return torch.cat([coords, torch.randn(2, 16, 768)], -1)


MM_TEXT = dict(vocab_size=120, num_key_value_heads=1, max_position_embeddings=64, **ENC)


def paligemma():
    vision = tf.SiglipVisionConfig(image_size=16, patch_size=8, projection_dim=32, **ENC)
    return tf.PaliGemmaForConditionalGeneration(tf.PaliGemmaConfig(
        vision_config=vision, text_config=tf.GemmaConfig(head_dim=16, **MM_TEXT),
        image_token_id=110, projection_dim=32))


def gemma3_mm():
    vision = tf.SiglipVisionConfig(image_size=16, patch_size=4, **ENC)
    text = tf.Gemma3TextConfig(head_dim=16, sliding_window=4, **MM_TEXT)
    return tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
        vision_config=vision, text_config=text, image_token_id=110, mm_tokens_per_image=4))


def mistral3():
    vision = tf.PixtralVisionConfig(image_size=16, patch_size=8, hidden_size=32,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=64, head_dim=16)
    return tf.Mistral3ForConditionalGeneration(tf.Mistral3Config(
        vision_config=vision, text_config=tf.MistralConfig(head_dim=16, **MM_TEXT),
        image_token_index=110, spatial_merge_size=1, vision_feature_layer=-1))


def image_prompt(**extra):
    """Four image tokens then text, one 16 x 16 image a row."""
    def make():
        tokens = torch.randint(0, 100, (2, 12))
        tokens[:, 1:5] = 110
        return {"input_ids": tokens, "pixel_values": torch.randn(2, 3, 16, 16),
                "use_cache": False, **{k: f() for k, f in extra.items()}}
    return make


def prefix_types():
    """PaliGemma's processor's token types: the image and prompt prefix 0, the suffix 1
    (without them transformers attends non-causally in eager, causally when traced)."""
    types = torch.zeros(2, 12, dtype=torch.int64)
    types[:, 8:] = 1
    return types


def spread(model):
    """Weights and BatchNorm statistics moved off their init: the tiny MobileNet's and
    MobileViT's init gives all-zero logits (a comparison against zero says nothing)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("running_var"):
                b.uniform_(0.5, 1.5)
            elif name.endswith("running_mean"):
                b.normal_(0, 0.1)
    return model


def rwkv():
    """RWKV rescales its weights in place on its first eval call: one eager call first
    (what kiln's error says to do)."""
    m = tf.RwkvForCausalLM(tf.RwkvConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                         attention_hidden_size=32, intermediate_size=64,
                                         context_length=32)).eval()
    with torch.no_grad():
        m(torch.randint(0, 100, (1, 4)), use_cache=False)
    return m


MODELS = {
    "ResNet": (lambda: tf.ResNetModel(tf.ResNetConfig(
        embedding_size=16, layer_type="basic", **STAGES)), image()),
    "ConvNext": (lambda: tf.ConvNextModel(tf.ConvNextConfig(num_stages=2, **STAGES)), image()),
    "ConvNextV2": (lambda: tf.ConvNextV2Model(tf.ConvNextV2Config(num_stages=2, **STAGES)),
                   image()),
    "Swin": (lambda: tf.SwinModel(tf.SwinConfig(**SWIN)), image()),
    "Swinv2": (lambda: tf.Swinv2Model(tf.Swinv2Config(**SWIN)), image()),
    "DeiT": (lambda: tf.DeiTModel(tf.DeiTConfig(**VIT)), image()),
    "BEiT": (lambda: tf.BeitModel(tf.BeitConfig(use_relative_position_bias=True, **VIT)),
             image()),
    "DINOv2": (lambda: tf.Dinov2Model(tf.Dinov2Config(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, mlp_ratio=2)), image()),
    "ViTMAE": (lambda: tf.ViTMAEModel(tf.ViTMAEConfig(mask_ratio=0.0, **VIT)),
               lambda: {**image()(), "noise": torch.rand(2, 16)}),
    "SigLIP-vision": (lambda: tf.SiglipVisionModel(tf.SiglipVisionConfig(**VIT)), image()),
    "Segformer": (lambda: tf.SegformerForSemanticSegmentation(tf.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
        decoder_hidden_size=32, num_labels=3)), image()),
    "DPT-depth": (lambda: tf.DPTForDepthEstimation(tf.DPTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=4,
        num_attention_heads=2, intermediate_size=64, backbone_out_indices=[0, 1, 2, 3],
        neck_hidden_sizes=[8, 8, 16, 16], fusion_hidden_size=16, head_hidden_size=8)),
                  image()),
    "MobileNetV2": (lambda: spread(tf.MobileNetV2ForImageClassification(tf.MobileNetV2Config(
        image_size=32, depth_multiplier=0.35, num_labels=10))), image()),
    "MobileViT": (lambda: spread(tf.MobileViTForImageClassification(tf.MobileViTConfig(
        image_size=32, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
        num_labels=10))), image()),
    "RegNet": (lambda: tf.RegNetModel(tf.RegNetConfig(
        embedding_size=16, groups_width=8, **STAGES)), image()),
    "PoolFormer": (lambda: tf.PoolFormerModel(tf.PoolFormerConfig(
        hidden_sizes=[16, 32, 32, 32], depths=[1, 1, 1, 1])), image()),
    "LeViT": (lambda: tf.LevitModel(tf.LevitConfig(
        image_size=32, hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3],
        depths=[1, 1, 1], key_dim=[8, 8, 8])), image()),
    "CLIP": (lambda: tf.CLIPModel(tf.CLIPConfig(
        text_config=dict(vocab_size=100, max_position_embeddings=16, **ENC),
        vision_config=dict(image_size=16, patch_size=8, **ENC), projection_dim=16)),
             lambda: {"input_ids": torch.randint(0, 100, (2, 7)),
                      "pixel_values": torch.randn(2, 3, 16, 16)}),
    "HuBERT": (lambda: tf.HubertModel(tf.HubertConfig(**AUDIO)), audio),
    "WavLM": (lambda: tf.WavLMModel(tf.WavLMConfig(**AUDIO)), audio),
    "T5": (lambda: tf.T5ForConditionalGeneration(tf.T5Config(
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=100,
        decoder_start_token_id=0)), seq2seq),
    "BART": (lambda: tf.BartForConditionalGeneration(tf.BartConfig(**SEQ2SEQ)), seq2seq),
    "Pegasus": (lambda: tf.PegasusForConditionalGeneration(tf.PegasusConfig(**SEQ2SEQ)),
                seq2seq),
    "Marian": (lambda: tf.MarianMTModel(tf.MarianConfig(
        decoder_start_token_id=0, pad_token_id=1, **SEQ2SEQ)), seq2seq),
    "Whisper": (lambda: tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        num_mel_bins=8, max_source_positions=16, max_target_positions=32,
        decoder_start_token_id=0, pad_token_id=1,
        **{k: v for k, v in SEQ2SEQ.items() if k != "max_position_embeddings"})),
                lambda: {"input_features": torch.randn(2, 8, 32),
                         "decoder_input_ids": torch.randint(3, 100, (2, 5)), "use_cache": False}),
    "MobileBERT": (lambda: tf.MobileBertModel(tf.MobileBertConfig(
        vocab_size=100, embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16,
        **ENC)), ids()),
    "Funnel": (lambda: tf.FunnelModel(tf.FunnelConfig(
        vocab_size=100, d_model=32, n_head=2, d_head=16, d_inner=64, block_sizes=[1, 1],
        num_decoder_layers=1)), ids(t=8)),
    "BERT-MLM-padded": (lambda: tf.BertForMaskedLM(tf.BertConfig(vocab_size=100, **ENC)),
                        lambda: {"input_ids": torch.randint(0, 100, (2, 9)),
                                 "attention_mask": torch.tensor([[1] * 9, [1] * 6 + [0] * 3])}),
    "DistilBERT-QA": (lambda: tf.DistilBertForQuestionAnswering(tf.DistilBertConfig(
        vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64)), ids()),
    "PatchTST": (lambda: tf.PatchTSTForPrediction(tf.PatchTSTConfig(
        num_input_channels=3, context_length=32, patch_length=8, patch_stride=8,
        prediction_length=8, d_model=16, num_attention_heads=2, num_hidden_layers=2,
        ffn_dim=32)), lambda: {"past_values": torch.randn(2, 32, 3)}),
    "Llava": (llava, llava_inputs),
    "Qwen2-VL-text": (qwen2_vl, ids(use_cache=False)),
    "Gemma3-text": (lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        vocab_size=100, num_key_value_heads=1, head_dim=16, sliding_window=4, **ENC)),
                    ids(use_cache=False)),
    "RecurrentGemma": (lambda: tf.RecurrentGemmaForCausalLM(tf.RecurrentGemmaConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, lru_width=32, attention_window_size=4,
        block_types=["recurrent", "attention"])), ids(use_cache=False)),
    "RWKV": (rwkv, ids(use_cache=False)),
    # the fifth sweep's second half
    "FocalNet": (lambda: tf.FocalNetModel(tf.FocalNetConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], focal_levels=[2, 2],
        focal_windows=[3, 3])), image()),
    "YOLOS": (lambda: tf.YolosForObjectDetection(tf.YolosConfig(
        image_size=[32, 32], patch_size=8, num_detection_tokens=5, num_labels=3, **ENC)),
              image()),
    "GLPN-depth": (lambda: tf.GLPNForDepthEstimation(tf.GLPNConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
        decoder_hidden_size=16)), image()),
    "Data2VecVision": (lambda: tf.Data2VecVisionModel(tf.Data2VecVisionConfig(
        use_relative_position_bias=True, **VIT)), image()),
    "Data2VecAudio": (lambda: tf.Data2VecAudioModel(tf.Data2VecAudioConfig(
        **{**AUDIO, "num_conv_pos_embeddings": 2, "conv_pos_kernel_size": 5})), audio),
    "SEW": (lambda: tf.SEWModel(tf.SEWConfig(squeeze_factor=2, **AUDIO)), audio),
    "UniSpeech": (lambda: tf.UniSpeechModel(tf.UniSpeechConfig(**AUDIO)), audio),
    "Speech2Text": (lambda: tf.Speech2TextForConditionalGeneration(tf.Speech2TextConfig(
        input_feat_per_channel=8, input_channels=1, conv_channels=16, num_conv_layers=2,
        conv_kernel_sizes=[5, 5], max_source_positions=64, max_target_positions=32,
        **{k: v for k, v in SEQ2SEQ.items() if k != "max_position_embeddings"})),
                    lambda: {"input_features": torch.randn(2, 20, 8),
                             "decoder_input_ids": torch.randint(3, 100, (2, 5)),
                             "use_cache": False}),
    "BigBird-full": (lambda: tf.BigBirdModel(tf.BigBirdConfig(
        vocab_size=100, attention_type="original_full", max_position_embeddings=64, **ENC)),
                     ids()),
    "XLNet": (lambda: tf.XLNetModel(tf.XLNetConfig(
        vocab_size=100, d_model=32, n_layer=2, n_head=2, d_inner=64)), ids(use_cache=False)),
    "ProphetNet": (lambda: tf.ProphetNetForConditionalGeneration(tf.ProphetNetConfig(
        vocab_size=100, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
        num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=2,
        num_decoder_attention_heads=2, ngram=2, max_position_embeddings=64)), seq2seq),
    "OWL-ViT": (lambda: tf.OwlViTModel(tf.OwlViTConfig(
        text_config=dict(vocab_size=100, max_position_embeddings=16, **ENC),
        vision_config=dict(image_size=32, patch_size=8, **ENC), projection_dim=16)),
                lambda: {"input_ids": torch.randint(0, 100, (2, 7)),
                         "pixel_values": torch.randn(2, 3, 32, 32)}),
    "BLIP": (lambda: tf.BlipModel(tf.BlipConfig(
        text_config=dict(vocab_size=100, max_position_embeddings=16, **ENC),
        vision_config=dict(image_size=32, patch_size=8, **ENC), projection_dim=16)),
             lambda: {"input_ids": torch.randint(0, 100, (2, 7)),
                      "pixel_values": torch.randn(2, 3, 32, 32)}),
    "MusicGen-decoder": (lambda: tf.MusicgenForCausalLM(tf.MusicgenDecoderConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
        num_codebooks=2, max_position_embeddings=64)),
                         lambda: {"input_ids": torch.randint(0, 64, (4, 6)),
                                  "use_cache": False}),
    # the sixth sweep (twenty-fifth session)
    "DeBERTa-v2": (lambda: tf.DebertaV2Model(tf.DebertaV2Config(
        vocab_size=100, relative_attention=True, position_buckets=8, max_relative_positions=16,
        pos_att_type=["p2c", "c2p"], **ENC)), ids()),
    "DeBERTa": (lambda: tf.DebertaModel(tf.DebertaConfig(
        vocab_size=100, relative_attention=True, max_relative_positions=16,
        pos_att_type=["p2c", "c2p"], **ENC)), ids()),
    "ELECTRA": (lambda: tf.ElectraForPreTraining(tf.ElectraConfig(
        vocab_size=100, embedding_size=16, **ENC)), ids()),
    "RoFormer": (lambda: tf.RoFormerModel(tf.RoFormerConfig(vocab_size=100, embedding_size=32,
                                                            **ENC)), ids()),
    "ConvBERT": (lambda: tf.ConvBertModel(tf.ConvBertConfig(vocab_size=100, embedding_size=32,
                                                            head_ratio=2, conv_kernel_size=3,
                                                            **ENC)), ids()),
    "MPNet": (lambda: tf.MPNetModel(tf.MPNetConfig(vocab_size=100, **ENC)), ids()),
    "ESM": (lambda: tf.EsmForMaskedLM(tf.EsmConfig(
        vocab_size=33, pad_token_id=1, mask_token_id=32, position_embedding_type="rotary",
        max_position_embeddings=64, **ENC)), ids(vocab=33)),
    "CANINE": (lambda: tf.CanineModel(tf.CanineConfig(
        downsampling_rate=2, num_hash_functions=2, num_hash_buckets=64, local_transformer_stride=4,
        **ENC)), lambda: {"input_ids": torch.randint(0, 200, (2, 12))}),
    "SqueezeBERT": (lambda: tf.SqueezeBertModel(tf.SqueezeBertConfig(
        vocab_size=100, embedding_size=32, q_groups=2, k_groups=2, v_groups=2,
        post_attention_groups=2, intermediate_groups=2, output_groups=2, **ENC)), ids()),
    "ALBERT": (lambda: tf.AlbertModel(tf.AlbertConfig(vocab_size=100, embedding_size=16, **ENC)),
               ids()),
    "LayoutLM": (lambda: tf.LayoutLMModel(tf.LayoutLMConfig(vocab_size=100, **ENC)),
                 lambda: {"input_ids": torch.randint(0, 100, (2, 9)),
                          "bbox": torch.sort(torch.randint(0, 1000, (2, 9, 4)), -1).values}),
    "LongT5": (lambda: tf.LongT5ForConditionalGeneration(tf.LongT5Config(
        local_radius=2, global_block_size=4, encoder_attention_type="transient-global",
        **T5ISH)), masked_seq2seq),
    "SwitchTransformers": (lambda: tf.SwitchTransformersForConditionalGeneration(
        tf.SwitchTransformersConfig(num_experts=4, expert_capacity=8, num_sparse_encoder_layers=1,
                                    num_sparse_decoder_layers=1, **T5ISH)), masked_seq2seq),
    "UMT5": (lambda: tf.UMT5ForConditionalGeneration(tf.UMT5Config(**T5ISH)), seq2seq),
    "mBART": (lambda: tf.MBartForConditionalGeneration(tf.MBartConfig(**SEQ2SEQ)), seq2seq),
    "M2M100": (lambda: tf.M2M100ForConditionalGeneration(tf.M2M100Config(**SEQ2SEQ)), seq2seq),
    "Blenderbot": (lambda: tf.BlenderbotForConditionalGeneration(tf.BlenderbotConfig(
        **SEQ2SEQ)), seq2seq),
    "TimeSeriesTransformer": (lambda: tf.TimeSeriesTransformerForPrediction(
        tf.TimeSeriesTransformerConfig(**TS)), ts_inputs),
    "Informer": (lambda: tf.InformerForPrediction(tf.InformerConfig(**TS)), ts_inputs),
    "Autoformer": (lambda: tf.AutoformerForPrediction(tf.AutoformerConfig(label_length=4, **TS)),
                   ts_inputs),
    "PatchTSMixer": (lambda: tf.PatchTSMixerForPrediction(tf.PatchTSMixerConfig(
        context_length=32, patch_length=8, patch_stride=8, num_input_channels=3,
        prediction_length=8, d_model=16, num_layers=2)),
                     lambda: {"past_values": torch.randn(2, 32, 3)}),
    "Wav2Vec2-Conformer": (lambda: tf.Wav2Vec2ConformerModel(tf.Wav2Vec2ConformerConfig(
        position_embeddings_type="rotary", conv_depthwise_kernel_size=3, **AUDIO)), audio),
    "Wav2Vec2-Conformer-rel": (lambda: tf.Wav2Vec2ConformerModel(tf.Wav2Vec2ConformerConfig(
        position_embeddings_type="relative", conv_depthwise_kernel_size=3, **AUDIO)), audio),
    "AST": (lambda: tf.ASTModel(tf.ASTConfig(
        num_mel_bins=16, max_length=32, patch_size=8, frequency_stride=8, time_stride=8, **ENC)),
            lambda: {"input_values": torch.randn(2, 32, 16)}),
    "EnCodec": (lambda: tf.EncodecModel(tf.EncodecConfig(
        num_filters=4, hidden_size=16, upsampling_ratios=[4, 2], codebook_size=32,
        codebook_dim=16, num_lstm_layers=1, target_bandwidths=[1.5], sampling_rate=2400)),
                lambda: {"input_values": torch.randn(2, 1, 64)}),
    "PVTv2": (lambda: tf.PvtV2Model(tf.PvtV2Config(
        image_size=32, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
        hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
        mlp_ratios=[2, 2])), image()),
    "Hiera": (lambda: tf.HieraModel(tf.HieraConfig(
        image_size=[32, 32], patch_size=[3, 3], patch_stride=[2, 2], patch_padding=[1, 1],
        embed_dim=16, depths=[1, 1], num_heads=[1, 2], query_stride=[2, 2],
        masked_unit_size=[4, 4], masked_unit_attention=[True, False], num_query_pool=1)), image()),
    "DINOv2-registers": (lambda: tf.Dinov2WithRegistersModel(tf.Dinov2WithRegistersConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        mlp_ratio=2, num_register_tokens=2)), image()),
    "Swin2SR": (lambda: tf.Swin2SRForImageSuperResolution(tf.Swin2SRConfig(
        image_size=16, patch_size=1, embed_dim=16, depths=[1], num_heads=[2], window_size=4,
        upscale=2, upsampler="pixelshuffle")), image(16)),
    "BiT": (lambda: spread(tf.BitModel(tf.BitConfig(
        embedding_size=32, hidden_sizes=[32, 64], depths=[1, 1], layer_type="preactivation",
        num_groups=4))),
            image()),
    "ImageGPT": (lambda: tf.ImageGPTModel(tf.ImageGPTConfig(
        vocab_size=33, n_positions=64, n_embd=32, n_layer=2, n_head=2)),
                 lambda: {"input_ids": torch.randint(0, 32, (2, 16)), "use_cache": False}),
    "ViTDet": (lambda: tf.VitDetModel(tf.VitDetConfig(
        image_size=32, pretrain_image_size=32, patch_size=8, hidden_size=32,
        num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, window_size=2,
        window_block_indices=[0], use_relative_position_embeddings=True)), image()),
    "CLIPSeg": (lambda: tf.CLIPSegForImageSegmentation(tf.CLIPSegConfig(
        text_config=dict(vocab_size=100, max_position_embeddings=16, **ENC),
        vision_config=dict(image_size=32, patch_size=8, **ENC), projection_dim=16,
        extract_layers=[1], reduce_dim=16)),
                lambda: {"input_ids": torch.randint(0, 100, (2, 7)),
                         "pixel_values": torch.randn(2, 3, 32, 32)}),
    "GIT": (lambda: tf.GitForCausalLM(tf.GitConfig(
        vision_config=dict(image_size=16, patch_size=8, **ENC), vocab_size=100,
        max_position_embeddings=64, **ENC)),
            lambda: {"input_ids": torch.randint(0, 100, (2, 7)),
                     "pixel_values": torch.randn(2, 3, 16, 16), "use_cache": False}),
    "Pix2Struct": (lambda: tf.Pix2StructForConditionalGeneration(tf.Pix2StructConfig(
        text_config=dict(vocab_size=100, hidden_size=32, d_kv=8, d_ff=64, num_layers=2,
                         num_heads=4),
        vision_config=dict(hidden_size=32, patch_embed_hidden_size=768, d_kv=8, d_ff=64,
                           num_hidden_layers=2, num_attention_heads=4))),
                   lambda: {"flattened_patches": pix2struct_patches(),
                            "attention_mask": torch.ones(2, 16),
                            "decoder_input_ids": torch.randint(0, 100, (2, 5)),
                            "use_cache": False}),
    # multimodal LLMs (twenty-fifth session)
    "PaliGemma": (paligemma, image_prompt(token_type_ids=prefix_types)),
    "Gemma3-mm": (gemma3_mm, image_prompt()),
    "Mistral3": (mistral3, image_prompt(image_sizes=lambda: torch.tensor([[16, 16]] * 2))),
}
