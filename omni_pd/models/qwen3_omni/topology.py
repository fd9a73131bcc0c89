"""Qwen3-Omni-MoE's pipelines for vllm-omni 0.30 deploy files (`pipeline:` key).

As vllm-omni's `vllm_omni/model_executor/models/qwen3_omni/pipeline.py`, with omni-pd's input
processors, plus a P/D variant whose thinker is split into a prefill and a decode stage:
- `qwen3_omni_moe`: 0 thinker -> 1 talker -> 2 code2wav (the default);
- `qwen3_omni_moe_thinker_only`: 0 thinker, text out (vllm-omni's Captioner / Thinking variant);
- `qwen3_omni_moe_pd`: 0 thinker prefill -> 1 thinker decode -> 2 talker -> 3 code2wav (omni-pd's;
  chosen by the key, or when a deploy file marks `is_prefill_only` / `is_decode_only` stages).

The sampling defaults apply to a stage whose deploy entry sets no `default_sampling_params`
(one that sets them uses its own, as vllm-omni does); they are those of
stage_configs/qwen3_omni_moe.yaml, less the talker's `stop_token_ids: [2150]`: omni-pd's talker
stops at the checkpoint's `codec_eos_token_id` (2150 in the real model, another id in the tiny
one). vllm-omni's `sampling_constraints` (detokenize flags, that stop id) are not applied: omni-pd's
talker and code2wav engines read neither.
"""

from __future__ import annotations

from types import MappingProxyType

from omni_pd.config.topology import Topology, TopologyStage

MODEL_ARCH = "Qwen3OmniMoeForConditionalGeneration"
_PROC = "omni_pd.models.qwen3_omni.stage_input_processors"

_THINKER_PARAMS = MappingProxyType(
    {
        "temperature": 0.4,
        "top_p": 0.9,
        "top_k": 1,
        "max_tokens": 2048,
        "seed": 42,
        "detokenize": True,
        "repetition_penalty": 1.05,
    }
)
_TALKER_PARAMS = MappingProxyType(
    {
        "temperature": 0.9,
        "top_k": 50,
        "max_tokens": 4096,
        "seed": 42,
        "detokenize": False,
        "repetition_penalty": 1.05,
    }
)
_CODE2WAV_PARAMS = MappingProxyType(
    {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_tokens": 65536,
        "seed": 42,
        "detokenize": True,
        "repetition_penalty": 1.1,
    }
)


def _thinker(
    stage_id: int, *, role=None, source: tuple[int, ...] = (), final: bool = True, output: str = "latent"
) -> TopologyStage:
    return TopologyStage(
        stage_id=stage_id,
        model_stage="thinker",
        engine_output_type=output,
        engine_input_source=source,
        hf_config_name="thinker_config",
        final_output_type="text" if final else None,
        is_comprehension=True,
        role=role,
        default_sampling_params=_THINKER_PARAMS,
    )


def _talker(stage_id: int, source: int) -> TopologyStage:
    return TopologyStage(
        stage_id=stage_id,
        model_stage="talker",
        engine_output_type="latent",
        engine_input_source=(source,),
        custom_process_input_func=f"{_PROC}.thinker2talker",
        hf_config_name="talker_config",
        default_sampling_params=_TALKER_PARAMS,
    )


def _code2wav(stage_id: int, source: int) -> TopologyStage:
    return TopologyStage(
        stage_id=stage_id,
        model_stage="code2wav",
        engine_output_type="audio",
        engine_input_source=(source,),
        custom_process_input_func=f"{_PROC}.talker2code2wav",
        final_output_type="audio",
        default_sampling_params=_CODE2WAV_PARAMS,
    )


QWEN3_OMNI_MOE = Topology("qwen3_omni_moe", MODEL_ARCH, (_thinker(0), _talker(1, 0), _code2wav(2, 1)))
QWEN3_OMNI_MOE_THINKER_ONLY = Topology(
    "qwen3_omni_moe_thinker_only", MODEL_ARCH, (_thinker(0, output="text"),)
)
QWEN3_OMNI_MOE_PD = Topology(
    "qwen3_omni_moe_pd",
    MODEL_ARCH,
    (
        _thinker(0, role="prefill", final=False),
        _thinker(1, role="decode", source=(0,)),
        _talker(2, 1),
        _code2wav(3, 2),
    ),
)

PIPELINES: dict[str, Topology] = {
    t.name: t for t in (QWEN3_OMNI_MOE, QWEN3_OMNI_MOE_THINKER_ONLY, QWEN3_OMNI_MOE_PD)
}
DEFAULT_PIPELINE = QWEN3_OMNI_MOE.name
DEFAULT_PD_PIPELINE = QWEN3_OMNI_MOE_PD.name
