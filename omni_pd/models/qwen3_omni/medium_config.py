"""A 1.1 GB random Qwen3-Omni-MoE checkpoint config for testing real-layout loading.

The tiny model with its parts scaled so that they differ in size as in the real model: the
thinker largest (~0.8 GB of float32), the talker in the middle (~0.25 GB), code2wav smallest
(~0.04 GB). The bulk is MoE experts, which hold many bytes but run only `num_experts_per_tok`
per token, so the pipeline stays quick on a CPU. Token ids, vocabularies, head sizes and the
audio/vision encoders are the tiny model's (same tokenizer, same kernel paths).
"""

from __future__ import annotations

import copy
from typing import Any

from .tiny_config import tiny_config_dict

MEDIUM_THINKER_HIDDEN = 256


def medium_config_dict() -> dict[str, Any]:
    config = copy.deepcopy(tiny_config_dict())
    thinker = config["thinker_config"]
    thinker["text_config"].update(
        hidden_size=MEDIUM_THINKER_HIDDEN,
        intermediate_size=512,
        num_hidden_layers=8,
        moe_intermediate_size=512,
        num_experts=64,
    )
    # The encoders project into the thinker's width.
    thinker["audio_config"]["output_dim"] = MEDIUM_THINKER_HIDDEN
    thinker["vision_config"]["out_hidden_size"] = MEDIUM_THINKER_HIDDEN
    talker = config["talker_config"]
    talker["text_config"].update(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=5,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=512,
        num_experts=64,
    )
    # The code predictor reads the talker's hidden states: the same width.
    talker["code_predictor_config"].update(hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    talker["thinker_hidden_size"] = MEDIUM_THINKER_HIDDEN
    talker["accept_hidden_layer"] = 4
    config["code2wav_config"].update(hidden_size=256, intermediate_size=1024, num_hidden_layers=8)
    return config
