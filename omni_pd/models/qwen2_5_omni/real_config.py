"""Qwen2.5-Omni-7B's shapes with random weights: the real model's cost, measurable.

Every dimension is the published checkpoint's (Qwen/Qwen2.5-Omni-7B's `config.json`, as
transformers 5.x reads it): the thinker's dense 3584-wide text model (28 query / 4 KV heads of
128, MLP 18944, vocabulary 152064, M-RoPE sections 16/24/24); its 1280-wide audio encoder (20
heads, FFN 5120) and 1280-wide vision encoder (16 heads, MLP 3420, windowed with full attention
every 8th layer); the talker (896 wide, 12 / 4 heads of 128, MLP 18944, codec vocabulary 8448,
reading 3584-wide thinker states); token2wav's DiT (1024 wide, 16 heads of 64, 8193 code
embeddings, an ECAPA speaker encoder of 192) and BigVGAN (1536 initial channels, 240 samples a
mel frame). Only the number of layers of each transformer stack is cut, to `layers` (a stack with
fewer published layers keeps them all); the DiT's look-backward and look-ahead layers move with
the cut so that a cut DiT keeps the published receptive field.

What is not a dimension stays the embedded tiny model's: its byte-level tokenizer and the special
token ids it pins (all below 274, inside the real vocabulary; each voice's speech starts from its
tiny bos token), so the pipeline runs end to end on the same prompts. The codec's control ids are
the real talker's. The voices (`spk_dict.pt`) have the published shapes: a 192-wide speaker
embedding and a 400-frame reference mel.
"""

from __future__ import annotations

import copy
from typing import Any

from ..real_shapes import cut_stacks
from .tiny_config import tiny_config_dict

# The published stack depths (what `--layers` may cut, never exceed).
REAL_LAYERS = {
    "thinker": 28,
    "audio_encoder": 32,
    "vision_encoder": 32,
    "talker": 24,
    "dit": 22,
}
SOURCE = "https://huggingface.co/Qwen/Qwen2.5-Omni-7B/blob/main/config.json"

THINKER_HIDDEN = 3584
CODEC_IDS = {
    "tts_codec_pad_token_id": 8292,
    "tts_codec_start_token_id": 8293,
    "tts_codec_end_token_id": 8294,
    "tts_codec_mask_token_id": 8296,
}
SPEAKER_EMBEDDING = 192  # each voice's `cond` (the DiT's enc_emb_dim)
REF_MEL_FRAMES = 400  # each voice's reference mel, as spk_dict.pt holds it


def stack_layers(layers: int) -> dict[str, int]:
    """Each stack's layers when cut to `layers` (1 up to the encoders' 32); ValueError otherwise."""
    return cut_stacks(REAL_LAYERS, layers)


def _rope(theta: float, section: list[int] | None = None) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if section is not None:
        rope["mrope_section"] = section
    return rope


def _dit_context(depth: int) -> dict[str, list[int]]:
    """The published DiT (22 layers) looks back at layers 0 and 20 and ahead at layer 10: an
    output block reads two blocks before it and one after. A cut DiT keeps that receptive field
    as far as its depth allows (first and last layer back, the middle one ahead)."""
    if depth >= REAL_LAYERS["dit"]:
        return {"look_backward_layers": [0, 20], "look_ahead_layers": [10]}
    if depth >= 3:
        return {"look_backward_layers": [0, depth - 1], "look_ahead_layers": [depth // 2]}
    return {"look_backward_layers": [0], "look_ahead_layers": [depth - 1] if depth > 1 else []}


def real_config_dict(layers: int) -> dict[str, Any]:
    """The real model's config with every transformer stack cut to `layers` layers."""
    cut = stack_layers(layers)
    config = copy.deepcopy(tiny_config_dict())
    thinker = config["thinker_config"]
    thinker["text_config"].update(
        vocab_size=152064,
        hidden_size=THINKER_HIDDEN,
        intermediate_size=18944,
        num_hidden_layers=cut["thinker"],
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters=_rope(1000000.0, [16, 24, 24]),
    )
    thinker["audio_config"].update(
        d_model=1280,
        encoder_layers=cut["audio_encoder"],
        encoder_attention_heads=20,
        encoder_ffn_dim=5120,
        num_mel_bins=128,
        output_dim=THINKER_HIDDEN,
        n_window=100,
        max_source_positions=1500,
    )
    full_attention = [i for i in (7, 15, 23, 31) if i < cut["vision_encoder"]]
    thinker["vision_config"].update(
        depth=cut["vision_encoder"],
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=THINKER_HIDDEN,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        # The full-attention layers of the 32-layer encoder that a cut one still has (else its last).
        fullatt_block_indexes=full_attention or [cut["vision_encoder"] - 1],
    )
    config["talker_config"].update(
        vocab_size=8448,
        **CODEC_IDS,
        embedding_size=THINKER_HIDDEN,
        hidden_size=896,
        intermediate_size=18944,
        num_hidden_layers=cut["talker"],
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters=_rope(1000000.0, [16, 24, 24]),
    )
    token2wav = config["token2wav_config"]
    token2wav["dit_config"].update(
        hidden_size=1024,
        num_hidden_layers=cut["dit"],
        num_attention_heads=16,
        head_dim=64,
        ff_mult=2,
        emb_dim=512,
        num_embeds=8193,
        mel_dim=80,
        enc_emb_dim=SPEAKER_EMBEDDING,
        enc_dim=128,
        enc_channels=[256, 256, 256, 256, 768],
        enc_kernel_sizes=[5, 3, 3, 3, 1],
        enc_dilations=[1, 2, 3, 4, 1],
        enc_attention_channels=64,
        enc_res2net_scale=2,
        enc_se_channels=64,
        block_size=24,
        repeats=2,
        **_dit_context(cut["dit"]),
        rope_parameters=_rope(10000.0),
    )
    token2wav["bigvgan_config"].update(
        mel_dim=80,
        upsample_initial_channel=1536,
        resblock_kernel_sizes=[3, 7, 11],
        resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        upsample_rates=[5, 3, 2, 2, 2, 2],
        upsample_kernel_sizes=[11, 7, 4, 4, 4, 4],
    )
    config["torch_dtype"] = "bfloat16"
    return config
