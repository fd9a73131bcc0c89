"""The embedded tiny Qwen2.5-Omni: a config of ~0.5 M parameters that runs thinker -> talker ->
token2wav on a CPU in well under a second. Token ids are pinned to the tokenizer built in
`tokenizer.py`. The thinker's shapes also load in vLLM (head_dim 32, the smallest its CPU attention
runs; M-RoPE sections summing to head_dim / 2), so hf and vLLM thinkers run the same weights.

Where this differs from Qwen3-Omni's tiny config, it is Qwen2.5-Omni's own shape: a dense thinker
(q/k/v biases, no q/k norms, concatenated M-RoPE sections), a talker whose embeddings are as wide as
the thinker's (it reads the thinker's last hidden state plus its token embedding), a single codec
codebook, and a token2wav of a flow-matching DiT over blocks of 24 mel frames and a BigVGAN vocoder.
The DiT keeps the real model's receptive field (an output block reads the two blocks before it and
the one after: a backward layer first and last, a look-ahead layer between), so chunked token2wav
meets the same context limits as at the real shape.

`vision_start_token_id` is set on the thinker and talker configs although their classes do not
declare it: transformers' `get_rope_index` reads it (the real config.json carries it).
"""

from __future__ import annotations

from typing import Any

TINY_MODEL_NAME = "tiny-qwen2.5-omni"
DEFAULT_SEED = 0

# --- text-side vocabulary (tokenizer.py): 256 byte tokens, role words, then the specials ---
NUM_BYTE_TOKENS = 256
ROLE_TOKENS = {"system": 256, "user": 257, "assistant": 258}
SPECIAL_TOKENS = {
    "<|endoftext|>": 259,
    "<|im_start|>": 260,
    "<|im_end|>": 261,
    "<|audio_bos|>": 262,
    "<|audio_eos|>": 263,
    "<|AUDIO|>": 264,
    "<|vision_bos|>": 265,
    "<|vision_eos|>": 266,
    "<|IMAGE|>": 267,
    "<|VIDEO|>": 268,
    "<|tts_text_pad|>": 269,
    "<|tts_text_bos|>": 270,
    "<|tts_text_eod|>": 271,
    # The token each voice's speech starts from (spk_dict.pt's `bos_token`; thinker vocabulary).
    "<|tts_bos_ethan|>": 272,
    "<|tts_bos_chelsie|>": 273,
}
TEXT_VOCAB_SIZE = 274
# Voices as transformers' speaker map names them, each with its bos token.
VOICES = {"Chelsie": SPECIAL_TOKENS["<|tts_bos_chelsie|>"], "Ethan": SPECIAL_TOKENS["<|tts_bos_ethan|>"]}
DEFAULT_VOICE = "Chelsie"

# --- the talker's codec vocabulary: codebook entries first, then its specials ---
CODEBOOK_SIZE = 128
CODEC_IDS = {
    "tts_codec_pad_token_id": 128,
    "tts_codec_start_token_id": 129,
    "tts_codec_end_token_id": 130,
    "tts_codec_mask_token_id": 131,
}
TALKER_VOCAB_SIZE = 132

THINKER_HIDDEN = 64
THINKER_LAYERS = 4
REF_MEL_FRAMES = 30  # each voice's reference mel (spk_dict.pt's `ref_mel`): [1, frames, 80]
SPEAKER_EMBEDDING = 8  # each voice's `cond`: [1, enc_emb_dim]


def _rope(section: list[int]) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section}


def _token_ids() -> dict[str, int]:
    tok = SPECIAL_TOKENS
    return {
        "audio_token_index": tok["<|AUDIO|>"],
        "image_token_index": tok["<|IMAGE|>"],
        "video_token_index": tok["<|VIDEO|>"],
        "audio_start_token_id": tok["<|audio_bos|>"],
        "audio_end_token_id": tok["<|audio_eos|>"],
        "vision_start_token_id": tok["<|vision_bos|>"],
    }


def _thinker() -> dict[str, Any]:
    text_config = {
        "vocab_size": TEXT_VOCAB_SIZE,
        "hidden_size": THINKER_HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": THINKER_LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rope_parameters": _rope([4, 6, 6]),  # sums to head_dim / 2 (64 / 2 heads / 2)
    }
    audio_config = {
        "num_mel_bins": 128,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "output_dim": THINKER_HIDDEN,
        "n_window": 100,
        "max_source_positions": 1500,
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": THINKER_HIDDEN,
        "fullatt_block_indexes": [0],
    }
    return {
        "text_config": text_config,
        "audio_config": audio_config,
        "vision_config": vision_config,
        **_token_ids(),
        "user_token_id": ROLE_TOKENS["user"],
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
    }


def _talker() -> dict[str, Any]:
    tok = SPECIAL_TOKENS
    return {
        "vocab_size": TALKER_VOCAB_SIZE,
        **CODEC_IDS,
        "tts_text_start_token_id": tok["<|tts_text_bos|>"],
        "tts_text_end_token_id": tok["<|tts_text_eod|>"],
        "tts_text_pad_token_id": tok["<|tts_text_pad|>"],
        **_token_ids(),
        "vision_end_token_id": tok["<|vision_eos|>"],
        "embedding_size": THINKER_HIDDEN,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rope_parameters": _rope([2, 3, 3]),
    }


def _token2wav() -> dict[str, Any]:
    dit = {
        "hidden_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "head_dim": 16,
        "ff_mult": 2,
        "emb_dim": 16,
        "num_embeds": TALKER_VOCAB_SIZE,
        "mel_dim": 80,
        "enc_emb_dim": SPEAKER_EMBEDDING,
        "enc_dim": 8,
        "enc_channels": [16, 16, 16, 32],  # the last is the sum of the middle ones (MFA concat)
        "enc_kernel_sizes": [5, 3, 3, 1],
        "enc_dilations": [1, 2, 3, 1],
        "enc_attention_channels": 8,
        "enc_res2net_scale": 2,
        "enc_se_channels": 8,
        "block_size": 24,
        "look_backward_layers": [0, 2],
        "look_ahead_layers": [1],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    bigvgan = {
        "mel_dim": 80,
        "upsample_initial_channel": 64,
        "resblock_kernel_sizes": [3],
        "resblock_dilation_sizes": [[1, 3, 5]],
        "upsample_rates": [5, 3, 2, 2, 2, 2],  # 240 samples a mel frame, as in the real model
        "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
    }
    return {"dit_config": dit, "bigvgan_config": bigvgan}


def tiny_config_dict() -> dict[str, Any]:
    """The config as plain data (what `config.json` holds)."""
    return {
        "architectures": ["Qwen2_5OmniForConditionalGeneration"],
        "model_type": "qwen2_5_omni",
        "thinker_config": _thinker(),
        "talker_config": _talker(),
        "token2wav_config": _token2wav(),
        "enable_audio_output": True,
        "torch_dtype": "float32",
    }
