"""Qwen3-Omni-30B-A3B-Instruct's shapes with random weights: the real model's cost, measurable.

Every dimension is the published checkpoint's (`config.json` of Qwen/Qwen3-Omni-30B-A3B-Instruct
on the Hugging Face Hub, as transformers 5.x reads it): the thinker's 2048-wide text model with 32
query / 4 KV heads of 128, 128 experts (top-8) of 768, vocabulary 152064; its 1280-wide audio
encoder and 1152-wide vision encoder; the talker (1024 wide, 16 / 2 heads, 128 experts top-6 of
384 and a shared expert of 768, codec vocabulary 3072); its code predictor (1024 wide, 16 / 8
heads, 16 code groups of 2048); code2wav (1024 wide, decoder 1536 channels, 16 quantizers). Only
the number of layers of each transformer stack is cut, to `layers` (a stack with fewer published
layers keeps them all).

What is not a dimension stays the embedded tiny model's: its byte-level tokenizer and the special
token ids it pins (all below 272, inside the real vocabulary), so the pipeline runs end to end on
the same prompts. The codec's control ids and voices are the real talker's.
"""

from __future__ import annotations

import copy
from typing import Any

from ..real_shapes import cut_stacks
from .tiny_config import tiny_config_dict

# The published stack depths (what `--layers` may cut, never exceed).
REAL_LAYERS = {
    "thinker": 48,
    "audio_encoder": 32,
    "vision_encoder": 27,
    "talker": 20,
    "code_predictor": 5,
    "code2wav": 8,
}
SOURCE = "https://huggingface.co/Qwen/Qwen3-Omni-30B-A3B-Instruct/blob/main/config.json"

THINKER_HIDDEN = 2048
CODEC_IDS = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
NUM_CODE_GROUPS = 16


def stack_layers(layers: int) -> dict[str, int]:
    """Each stack's layers when cut to `layers` (1 up to the thinker's 48); ValueError otherwise."""
    return cut_stacks(REAL_LAYERS, layers)


def real_config_dict(layers: int) -> dict[str, Any]:
    """The real model's config with every transformer stack cut to `layers` layers."""
    cut = stack_layers(layers)
    config = copy.deepcopy(tiny_config_dict())
    thinker = config["thinker_config"]
    thinker["text_config"].update(
        vocab_size=152064,
        hidden_size=THINKER_HIDDEN,
        intermediate_size=768,
        num_hidden_layers=cut["thinker"],
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=65536,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
            "interleaved": True,
        },
    )
    thinker["audio_config"].update(
        d_model=1280,
        encoder_layers=cut["audio_encoder"],
        encoder_attention_heads=20,
        encoder_ffn_dim=5120,
        num_mel_bins=128,
        output_dim=THINKER_HIDDEN,
        downsample_hidden_size=480,
        n_window=50,
        n_window_infer=800,
        conv_chunksize=500,
        max_source_positions=1500,
    )
    thinker["vision_config"].update(
        depth=cut["vision_encoder"],
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=THINKER_HIDDEN,
        num_position_embeddings=2304,
        image_size=768,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        # The deepstack taps of the 27-layer encoder (8, 16, 24) that a cut encoder still has.
        deepstack_visual_indexes=[i for i in (8, 16, 24) if i < cut["vision_encoder"]]
        or [cut["vision_encoder"] - 1],
    )
    talker = config["talker_config"]
    talker["text_config"].update(
        vocab_size=3072,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=cut["talker"],
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        moe_intermediate_size=384,
        shared_expert_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=6,
        norm_topk_prob=True,
        max_position_embeddings=65536,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
            "interleaved": True,
        },
    )
    talker["code_predictor_config"].update(
        vocab_size=2048,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=cut["code_predictor"],
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        num_code_groups=NUM_CODE_GROUPS,
        max_position_embeddings=32768,
    )
    talker.update(
        num_code_groups=NUM_CODE_GROUPS,
        thinker_hidden_size=THINKER_HIDDEN,
        # The published model reads the middle of its 48 layers (24); a cut thinker, its middle.
        accept_hidden_layer=cut["thinker"] // 2,
        speaker_id=dict(SPEAKERS),
        **CODEC_IDS,
    )
    config["code2wav_config"].update(
        codebook_size=2048,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=cut["code2wav"],
        num_attention_heads=16,
        num_key_value_heads=16,
        num_quantizers=NUM_CODE_GROUPS,
        decoder_dim=1536,
        sliding_window=72,
        max_position_embeddings=8000,
        upsample_rates=[8, 5, 4, 3],
        upsampling_ratios=[2, 2],
    )
    config["torch_dtype"] = "bfloat16"
    return config
