"""vLLM's Qwen3-Omni thinker, recording per token what the talker reads: the layer-0 embeddings
(audio features merged in) and the hidden states at the talker's `accept_hidden_layer`.

Registered for the checkpoint's architecture (`Qwen3OmniMoeForConditionalGeneration`) in vLLM's
ModelRegistry by the vLLM engine and by omni-pd's `vllm.general_plugins` entry point. It records
only when the engine asks for it through `additional_config` (`omni_pd_capture_rows`, with the
layer: both enter vLLM's compile-cache key, so a cached graph never returns another layer's
states). Otherwise it is vLLM's thinker unchanged.

Layer k of transformers' `hidden_states` is the residual stream after decoder layer k - 1 (0:
the embeddings). vLLM's decoder layers carry the residual apart from the hidden states; its
EAGLE-3 auxiliary outputs (`set_aux_hidden_state_layers`) add the two back together at a layer's
output, which is the same tensor, and they are computed inside the compiled language model. The
last layer is different (transformers normalises it), so an accept layer must be below the last.
"""

from __future__ import annotations

from vllm.model_executor.models.qwen3_omni_moe_thinker import Qwen3OmniMoeThinkerForConditionalGeneration

from omni_pd.engines.vllm.rows import SINK_ATTRIBUTE

CAPTURE_KEY = "omni_pd_capture_rows"
LAYER_KEY = "omni_pd_accept_hidden_layer"


class RowRecordingThinker(Qwen3OmniMoeThinkerForConditionalGeneration):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
        setattr(self, SINK_ATTRIBUTE, None)
        self.accept_layer: int | None = None
        if extra.get(CAPTURE_KEY):
            layer = int(extra[LAYER_KEY])
            layers = self.config.text_config.num_hidden_layers
            if not 1 <= layer < layers:
                raise ValueError(
                    f"accept_hidden_layer {layer} must be between 1 and {layers - 1} "
                    f"(the thinker has {layers} layers; the last one's output is "
                    "normalised in transformers and not in vLLM)"
                )
            self.accept_layer = layer
            self.set_aux_hidden_state_layers((layer,))  # before the language model is compiled

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if self.accept_layer is None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        embeds = (
            inputs_embeds
            if inputs_embeds is not None
            else self.language_model.model.embed_input_ids(input_ids)
        )
        # A copy: on GPUs the first layer's fused add-norm writes into this buffer in place.
        embeds = embeds.detach().clone()
        hidden, aux = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        sink = getattr(self, SINK_ATTRIBUTE)
        if sink is not None:
            sink.record(embeds, aux[0])
        return hidden
