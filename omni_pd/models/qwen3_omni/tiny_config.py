"""The embedded tiny Qwen3-Omni-MoE: a ~1 M-parameter config that runs thinker -> talker -> code2wav
on a CPU in about a second. Token ids are pinned to the tokenizer built in `tokenizer.py`. The
thinker's config also loads in vLLM (its CPU attention's head sizes, M-RoPE sections summing to
head_dim / 2, and the keys of the real checkpoint that vLLM reads), so the hf and vLLM thinkers run
the same weights.

Config keys that transformers' modelling code reads but the config classes do not declare are set
explicitly (`shared_expert_intermediate_size`, `spatial_merge_size`, `vision_start_token_id`).
"""

from __future__ import annotations

from typing import Any

TINY_MODEL_NAME = "tiny-qwen3-omni"

# --- text-side vocabulary (see tokenizer.py): 256 byte tokens, then role words, then specials ---
NUM_BYTE_TOKENS = 256
ROLE_TOKENS = {"system": 256, "user": 257, "assistant": 258}
SPECIAL_TOKENS = {
    "<|endoftext|>": 259,
    "<|im_start|>": 260,
    "<|im_end|>": 261,
    "<|audio_start|>": 262,
    "<|audio_end|>": 263,
    "<|audio_pad|>": 264,
    "<|vision_start|>": 265,
    "<|vision_end|>": 266,
    "<|image_pad|>": 267,
    "<|video_pad|>": 268,
    "<|tts_pad|>": 269,
    "<|tts_bos|>": 270,
    "<|tts_eos|>": 271,
}
TEXT_VOCAB_SIZE = 272

# --- codec vocabulary of the talker: codebook entries first, specials after, then the band of
# 1024 ids the talker suppresses (transformers suppresses [vocab-1024, vocab) except codec_eos) ---
CODEBOOK_SIZE = 128
CODEC_IDS = {
    "codec_pad_id": 128,
    "codec_bos_id": 129,
    "codec_eos_token_id": 130,
    "codec_nothink_id": 131,
    "codec_think_bos_id": 132,
    "codec_think_eos_id": 133,
}
SPEAKERS = {"ethan": 134, "chelsie": 135}
TALKER_VOCAB_SIZE = CODEBOOK_SIZE + 1024
NUM_CODE_GROUPS = 4

THINKER_HIDDEN = 64
THINKER_LAYERS = 4
ACCEPT_HIDDEN_LAYER = 2


def tiny_config_dict() -> dict[str, Any]:
    """The config as plain data (what `config.json` holds)."""
    tok = SPECIAL_TOKENS
    text_config = {
        "vocab_size": TEXT_VOCAB_SIZE,
        "hidden_size": THINKER_HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": THINKER_LAYERS,
        # head_dim 32: the smallest head size vLLM's CPU attention runs (2 heads x 32 keep the
        # projections 64 wide, one KV head keeps a token's KV as large as 2 x 16 did).
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,  # vLLM reads it; the real checkpoint has it
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [6, 5, 5],  # sums to head_dim / 2, as vLLM's M-RoPE requires
            "mrope_interleaved": True,
            "interleaved": True,
        },
    }
    audio_config = {
        "num_mel_bins": 128,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "output_dim": THINKER_HIDDEN,
        "downsample_hidden_size": 16,
        "n_window": 50,
        "n_window_infer": 400,
        "max_source_positions": 1500,
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": THINKER_HIDDEN,
        "num_position_embeddings": 64,
        # What the real checkpoint has and vLLM reads: 8 x 8 position embeddings of 16-pixel patches.
        "image_size": 128,
        "apply_vit_abs_pos_embed": True,
        "deepstack_visual_indexes": [0],
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    thinker_config = {
        "text_config": text_config,
        "audio_config": audio_config,
        "vision_config": vision_config,
        "audio_token_id": tok["<|audio_pad|>"],
        "image_token_id": tok["<|image_pad|>"],
        "video_token_id": tok["<|video_pad|>"],
        "audio_start_token_id": tok["<|audio_start|>"],
        "vision_start_token_id": tok["<|vision_start|>"],
        "user_token_id": ROLE_TOKENS["user"],
        "position_id_per_seconds": 25,
    }
    talker_config = {
        "text_config": {
            "vocab_size": TALKER_VOCAB_SIZE,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
                "interleaved": True,
            },
        },
        "code_predictor_config": {
            "vocab_size": CODEBOOK_SIZE,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "num_code_groups": NUM_CODE_GROUPS,
            "max_position_embeddings": 64,
        },
        "num_code_groups": NUM_CODE_GROUPS,
        "thinker_hidden_size": THINKER_HIDDEN,
        "accept_hidden_layer": ACCEPT_HIDDEN_LAYER,
        **CODEC_IDS,
        "audio_token_id": tok["<|audio_pad|>"],
        "image_token_id": tok["<|image_pad|>"],
        "video_token_id": tok["<|video_pad|>"],
        "vision_start_token_id": tok["<|vision_start|>"],
        "audio_start_token_id": tok["<|audio_start|>"],
        "spatial_merge_size": 2,
        "speaker_id": dict(SPEAKERS),
    }
    code2wav_config = {
        "codebook_size": CODEBOOK_SIZE,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_quantizers": NUM_CODE_GROUPS,
        "decoder_dim": 64,
        "sliding_window": 72,
        "max_position_embeddings": 8000,
        # 8*5*4*3 * 2*2 = 1920 samples per codec frame, as in the real model (24 kHz, 12.5 Hz).
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
    }
    return {
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "model_type": "qwen3_omni_moe",
        "thinker_config": thinker_config,
        "talker_config": talker_config,
        "code2wav_config": code2wav_config,
        "enable_audio_output": True,
        "im_start_token_id": tok["<|im_start|>"],
        "im_end_token_id": tok["<|im_end|>"],
        "tts_pad_token_id": tok["<|tts_pad|>"],
        "tts_bos_token_id": tok["<|tts_bos|>"],
        "tts_eos_token_id": tok["<|tts_eos|>"],
        "system_token_id": ROLE_TOKENS["system"],
        "user_token_id": ROLE_TOKENS["user"],
        "assistant_token_id": ROLE_TOKENS["assistant"],
        "torch_dtype": "float32",
    }
