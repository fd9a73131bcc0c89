"""vLLM's Qwen2.5-Omni thinker, recording per token what the talker reads: the token's embedding
and the last hidden state after the final norm (what vLLM's thinker `forward` returns).

Registered for the checkpoint's architecture (`Qwen2_5OmniForConditionalGeneration`) in vLLM's
ModelRegistry by the vLLM engine and by omni-pd's `vllm.general_plugins` entry point. It records
only when the engine asks through `additional_config` (`omni_pd_capture_rows`, which enters
vLLM's compile-cache key); otherwise it is vLLM's thinker unchanged.
"""

from __future__ import annotations

from vllm.model_executor.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerForConditionalGeneration

from omni_pd.engines.vllm.rows import SINK_ATTRIBUTE

CAPTURE_KEY = "omni_pd_capture_rows"


class RowRecordingThinker(Qwen2_5OmniThinkerForConditionalGeneration):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
        setattr(self, SINK_ATTRIBUTE, None)
        self.capture = bool(extra.get(CAPTURE_KEY))

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if not self.capture:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        embeds = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        # A copy: on GPUs the first layer's fused add-norm writes into this buffer in place.
        embeds = embeds.detach().clone()
        hidden = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        sink = getattr(self, SINK_ATTRIBUTE)
        if sink is not None:
            sink.record(embeds, hidden)
        return hidden
