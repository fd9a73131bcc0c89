"""`Omni`: the offline API. Loads a stage YAML, starts one worker per stage and routes each
request's outputs along the stage edges through the stages' input processors. With a P/D pair the
thinker runs twice: a prefill leg (stop conditions neutralised, KV published) and a decode leg
(KV fetched over Mooncake), then the prefill leg's KV lease is released."""
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
from ..engines.base import StageInputs
from ..engines.types import AudioOutput, ThinkerOutput, ThinkerPrompt
from ..models.qwen3_omni.factory import load_config, load_tokenizer, resolve_model
from ..models.qwen3_omni.prompt import PromptBuilder, normalize_prompt
from ..models.qwen3_omni.tiny_config import TINY_MODEL_NAME
from ..paths import default_stage_config
from ..planning import (build_decode_sampling_params, build_prefill_sampling_params,
                        expand_sampling_params, find_pd_pair, new_transfer_id)
from ..sampling import SamplingParams
from .graph import topological_order
from .outputs import OmniRequestOutput
from .request_state import RequestState
from .stage_client import LocalStageClient, StageClient, StageError

log = logging.getLogger(__name__)
DEFAULT_REQUEST_TIMEOUT_S = 300.0
DEFAULT_STARTUP_TIMEOUT_S = 600.0


def _import_processor(dotted: str) -> Callable[[StageInputs], Any]:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


class Omni:
    """Offline multi-stage inference: `Omni(model=..., stage_configs_path=...).generate(prompts)`."""

    def __init__(self, model: str = TINY_MODEL_NAME, stage_configs_path: str | Path | None = None,
                 *, keep_stage_outputs: bool = False,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S):
        self.model = model
        self.stage_configs_path = Path(stage_configs_path or default_stage_config())
        self.config: PipelineConfig = load_pipeline_config(self.stage_configs_path)
        self.keep_stage_outputs = keep_stage_outputs
        self.request_timeout_s = request_timeout_s
        self.stages = {s.stage_id: s for s in self.config.stages}
        self.order = topological_order({s.stage_id: tuple(s.engine_input_source)
                                        for s in self.config.stages})
        self.pd_pair = find_pd_pair(self.config)
        if self.pd_pair:
            log.info("prefill/decode pair detected: stage %d prefills, stage %d decodes",
                     self.pd_pair.prefill_stage_id, self.pd_pair.decode_stage_id)
        self.text_stage_id = self._final_stage("text")
        source = resolve_model(model)
        self.model_config = load_config(source)
        self.prompt_builder = PromptBuilder(load_tokenizer(source), self.model_config.thinker_config)
        self.processors = {s.stage_id: _import_processor(s.custom_process_input_func)
                           for s in self.config.stages if s.custom_process_input_func}
        self._requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self.clients: dict[int, StageClient | LocalStageClient] = {}
        try:
            # Start every worker first, then wait: the stages load their models in parallel.
            for stage_id in self.order:
                stage = self.stages[stage_id]
                self.clients[stage_id] = (StageClient(stage, model, startup_timeout_s)
                                          if stage.runtime.process else LocalStageClient(stage, model))
            for client in self.clients.values():
                client.wait_ready()
        except BaseException:
            self.close()
            raise

    def _final_stage(self, kind: str) -> int:
        finals = [s.stage_id for s in self.config.stages
                  if s.final_output and s.final_output_type == kind]
        if not finals:
            thinkers = [s.stage_id for s in self.config.stages if s.model_stage == "thinker"]
            return thinkers[-1]
        return finals[-1]

    # ---- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        clients, self.clients = self.clients, {}
        for client in clients.values():
            try:
                client.close()
            except Exception:  # keep closing the others
                log.exception("closing stage %d failed", client.stage_id)

    def __enter__(self) -> "Omni":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "clients", None):
            self.close()

    @property
    def worker_pids(self) -> list[int]:
        return [c.process.pid for c in self.clients.values() if c.process is not None]

    def debug_state_counts(self) -> dict[str, int]:
        """Per-request state on every side: all zero between requests."""
        counts = {"orchestrator.requests": len(self._requests)}
        for stage_id, client in self.clients.items():
            for key, value in client.control("debug_state_counts").items():
                counts[f"stage{stage_id}.{key}"] = value
        return counts

    def control(self, stage_id: int, name: str, **kwargs: Any) -> Any:
        """Call a stage engine's control function (tests and operators)."""
        return self.clients[stage_id].control(name, **kwargs)

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
        if not self.clients:
            raise RuntimeError("this Omni is closed")
        batch = prompts if isinstance(prompts, (list, tuple)) and not _is_messages(prompts) else [prompts]
        params = self.stage_params(sampling_params_list)
        results = []
        for prompt in tqdm(batch, desc="omni-pd", unit="req", disable=not use_tqdm or len(batch) < 2):
            results.append(self._run_one(prompt, self._with_seeds(params)))
        return results

    def _stage_call(self, state: RequestState, stage_id: int, thinker_prompt: ThinkerPrompt) -> Any:
        stage = self.stages[stage_id]
        params = state.params[stage_id]
        prompt: Any = thinker_prompt
        pair = self.pd_pair
        if pair and stage_id == pair.prefill_stage_id:
            state.transfer_id = new_transfer_id(state.request_id)
            params = build_prefill_sampling_params(params, state.transfer_id)
        elif pair and stage_id == pair.decode_stage_id:
            prefill_out = state.outputs[pair.prefill_stage_id]
            params = build_decode_sampling_params(params, prefill_out.kv_transfer_params or {},
                                                  state.transfer_id)
            # The KV covers the prompt (audio included): the decode leg needs only the token ids.
            prompt = ThinkerPrompt(prompt_token_ids=list(thinker_prompt.prompt_token_ids))
        elif stage.engine_input_source:
            prompt = self.processors[stage_id](StageInputs(
                request_id=state.request_id, stage_id=stage_id,
                source_stage_ids=tuple(stage.engine_input_source), upstream=dict(state.outputs),
                model_config=self.model_config, speaker=state.prompt.speaker))
        remaining = self.request_timeout_s - state.elapsed_ms() / 1e3
        if remaining <= 0:
            raise StageError(f"request {state.request_id} passed its {self.request_timeout_s:.0f} s "
                             f"deadline before stage {stage_id}")
        return self.clients[stage_id].generate(state.request_id, prompt, params, remaining)

    def _run_one(self, prompt: Any, params: dict[int, SamplingParams]) -> OmniRequestOutput:
        request_id = f"req-{next(self._ids)}-{secrets.token_hex(4)}"
        state = RequestState(request_id=request_id, prompt=normalize_prompt(prompt), params=params)
        self._requests[request_id] = state
        try:
            thinker_prompt = self.prompt_builder.build(state.prompt)
            for stage_id in self.order:
                began = time.perf_counter()
                output = self._stage_call(state, stage_id, thinker_prompt)
                state.stage_ms[stage_id] = state.elapsed_ms(began)
                if stage_id == self.text_stage_id and "first_token_ms" in output.metrics:
                    state.first_token_at = (began - state.started) * 1e3 + output.metrics["first_token_ms"]
                state.outputs[stage_id] = output
                if self.pd_pair and stage_id == self.pd_pair.decode_stage_id:
                    self._release_kv(state)
            return self._finish(state)
        finally:
            self._release_kv(state)
            del self._requests[request_id]

    def _release_kv(self, state: RequestState) -> None:
        # The decode leg has its copy (or failed): the prefill leg may free the blocks now rather
        # than at lease expiry.
        if state.transfer_id is None or state.kv_released:
            return
        state.kv_released = True
        try:
            self.clients[self.pd_pair.prefill_stage_id].control("release_kv",
                                                                transfer_id=state.transfer_id)
        except StageError as exc:
            log.warning("request %s: could not release KV lease %s (%s); it expires on its own",
                        state.request_id, state.transfer_id, exc)

    def _finish(self, state: RequestState) -> OmniRequestOutput:
        thinker: ThinkerOutput = state.outputs[self.text_stage_id]
        audio = next((o for o in state.outputs.values() if isinstance(o, AudioOutput)), None)
        metrics: dict[str, Any] = {
            "ttft_ms": state.first_token_at,
            "e2e_ms": state.elapsed_ms(),
            "stage_ms": {str(k): v for k, v in state.stage_ms.items()},
            "prompt_tokens": len(thinker.prompt_token_ids),
            "completion_tokens": len(thinker.token_ids),
        }
        for key in ("kv_bytes_transferred", "kv_transfer_ms"):
            if key in thinker.metrics:
                metrics[key] = thinker.metrics[key]
        if self.pd_pair:
            metrics["num_cached_prompt_tokens"] = thinker.num_cached_prompt_tokens
        return OmniRequestOutput(
            request_id=state.request_id, prompt_token_ids=thinker.prompt_token_ids,
            token_ids=thinker.token_ids, text=thinker.text, finish_reason=thinker.finish_reason,
            audio=audio.audio if audio else None, sample_rate=audio.sample_rate if audio else None,
            metrics=metrics, stage_outputs=dict(state.outputs) if self.keep_stage_outputs else None)


def _is_messages(value: Iterable) -> bool:
    # A list of chat messages is one prompt, not a batch.
    return bool(value) and all(isinstance(v, dict) and "role" in v for v in value)
