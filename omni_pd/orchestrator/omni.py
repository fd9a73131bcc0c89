"""`Omni`: the offline API. Loads a stage YAML, builds one engine per stage and routes each
request's outputs along the stage edges through the stages' input processors."""
from __future__ import annotations

import importlib
import itertools
import logging
import secrets
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from tqdm import tqdm

from ..config import PipelineConfig, load_pipeline_config
from ..engines.base import StageEngine, StageInputs
from ..engines.types import AudioOutput, ThinkerOutput
from ..models.qwen3_omni.factory import load_config, load_tokenizer, resolve_model
from ..models.qwen3_omni.prompt import PromptBuilder, normalize_prompt
from ..models.qwen3_omni.tiny_config import TINY_MODEL_NAME
from ..paths import default_stage_config
from ..planning import expand_sampling_params, find_pd_pair
from ..sampling import SamplingParams
from .graph import topological_order
from .outputs import OmniRequestOutput
from .request_state import RequestState

log = logging.getLogger(__name__)


def _import_processor(dotted: str) -> Callable[[StageInputs], Any]:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def build_engine(stage, model: str) -> StageEngine:
    if stage.engine == "hf":
        from ..engines.hf.stage_engines import build_hf_engine
        return build_hf_engine(stage, model)
    raise NotImplementedError(f"stage {stage.stage_id}: engine {stage.engine!r} is not available in "
                              "this build; use engine: hf")


class Omni:
    """Offline multi-stage inference: `Omni(model=..., stage_configs_path=...).generate(prompts)`."""

    def __init__(self, model: str = TINY_MODEL_NAME, stage_configs_path: str | Path | None = None,
                 *, keep_stage_outputs: bool = False):
        self.model = model
        self.stage_configs_path = Path(stage_configs_path or default_stage_config())
        self.config: PipelineConfig = load_pipeline_config(self.stage_configs_path)
        self.keep_stage_outputs = keep_stage_outputs
        self.stages = {s.stage_id: s for s in self.config.stages}
        self.order = topological_order({s.stage_id: tuple(s.engine_input_source)
                                        for s in self.config.stages})
        self.pd_pair = find_pd_pair(self.config)
        source = resolve_model(model)
        self.model_config = load_config(source)
        self.prompt_builder = PromptBuilder(load_tokenizer(source), self.model_config.thinker_config)
        self.processors = {s.stage_id: _import_processor(s.custom_process_input_func)
                           for s in self.config.stages if s.custom_process_input_func}
        self._requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self.engines: dict[int, StageEngine] = {}
        try:
            for stage_id in self.order:
                began = time.perf_counter()
                self.engines[stage_id] = build_engine(self.stages[stage_id], model)
                log.info("stage %d (%s) started in %.2f s", stage_id,
                         self.stages[stage_id].model_stage, time.perf_counter() - began)
        except BaseException:
            self.close()
            raise

    # ---- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        engines, self.engines = self.engines, {}
        for engine in engines.values():
            engine.close()

    def __enter__(self) -> "Omni":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def debug_state_counts(self) -> dict[str, int]:
        counts = {"orchestrator.requests": len(self._requests)}
        for stage_id, engine in self.engines.items():
            for key, value in engine.debug_state_counts().items():
                counts[f"stage{stage_id}.{key}"] = value
        return counts

    # ---- requests --------------------------------------------------------------------------
    def stage_params(self, sampling_params_list: Sequence[SamplingParams | None] | None
                     ) -> dict[int, SamplingParams]:
        ordered = [s.stage_id for s in self.config.stages]
        given = list(sampling_params_list) if sampling_params_list is not None else [None] * len(ordered)
        if len(given) != len(ordered):
            # One entry per logical stage (the thinker counted once): the decode leg gets a copy.
            given = expand_sampling_params(given, self.config)
        return {sid: p if p is not None else self.stages[sid].default_sampling_params
                for sid, p in zip(ordered, given)}

    def _with_seeds(self, params: dict[int, SamplingParams]) -> dict[int, SamplingParams]:
        # An unseeded sampled request gets one random seed, shared by every leg of its stage, so
        # that a P/D pair samples exactly as one engine would.
        seed = secrets.randbelow(2**31)
        return {sid: p if p.seed is not None or p.greedy else p.replace(seed=seed)
                for sid, p in params.items()}

    def generate(self, prompts: Any, sampling_params_list: Sequence[SamplingParams | None] | None = None,
                 *, use_tqdm: bool = True) -> list[OmniRequestOutput]:
        if not self.engines:
            raise RuntimeError("this Omni is closed")
        batch = prompts if isinstance(prompts, (list, tuple)) and not _is_messages(prompts) else [prompts]
        params = self.stage_params(sampling_params_list)
        results = []
        for prompt in tqdm(batch, desc="omni-pd", unit="req", disable=not use_tqdm or len(batch) < 2):
            results.append(self._run_one(prompt, self._with_seeds(params)))
        return results

    def _run_one(self, prompt: Any, params: dict[int, SamplingParams]) -> OmniRequestOutput:
        request_id = f"req-{next(self._ids)}-{secrets.token_hex(4)}"
        state = RequestState(request_id=request_id, prompt=normalize_prompt(prompt), params=params)
        self._requests[request_id] = state
        try:
            thinker_prompt = self.prompt_builder.build(state.prompt)
            for stage_id in self.order:
                stage = self.stages[stage_id]
                if stage.engine_input_source:
                    stage_prompt = self.processors[stage_id](StageInputs(
                        request_id=request_id, stage_id=stage_id,
                        source_stage_ids=tuple(stage.engine_input_source),
                        upstream=dict(state.outputs), model_config=self.model_config,
                        speaker=state.prompt.speaker))
                else:
                    stage_prompt = thinker_prompt
                began = time.perf_counter()
                output = self.engines[stage_id].generate(request_id, stage_prompt, params[stage_id])
                state.stage_ms[stage_id] = state.elapsed_ms(began)
                if isinstance(output, ThinkerOutput) and state.first_token_at is None \
                        and "ttft_ms" in output.metrics:
                    state.first_token_at = (began - state.started) * 1e3 + output.metrics["ttft_ms"]
                state.outputs[stage_id] = output
            return self._finish(state)
        finally:
            del self._requests[request_id]

    def _finish(self, state: RequestState) -> OmniRequestOutput:
        text_out = [o for o in state.outputs.values()
                    if isinstance(o, ThinkerOutput) and o.finish_reason != "prefill"]
        thinker = text_out[-1]
        audio = next((o for o in state.outputs.values() if isinstance(o, AudioOutput)), None)
        metrics: dict[str, Any] = {
            "ttft_ms": state.first_token_at,
            "e2e_ms": state.elapsed_ms(),
            "stage_ms": {str(k): v for k, v in state.stage_ms.items()},
            "prompt_tokens": len(thinker.prompt_token_ids),
            "completion_tokens": len(thinker.token_ids),
        }
        return OmniRequestOutput(
            request_id=state.request_id, prompt_token_ids=thinker.prompt_token_ids,
            token_ids=thinker.token_ids, text=thinker.text, finish_reason=thinker.finish_reason,
            audio=audio.audio if audio else None, sample_rate=audio.sample_rate if audio else None,
            metrics=metrics, stage_outputs=dict(state.outputs) if self.keep_stage_outputs else None)


def _is_messages(value: Iterable) -> bool:
    # A list of chat messages is one prompt, not a batch.
    return bool(value) and all(isinstance(v, dict) and "role" in v for v in value)
