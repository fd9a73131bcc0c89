"""hf (transformers) engines for the three Qwen3-Omni stages, built from a stage config."""
from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch

from ...models.qwen3_omni.factory import load_model, load_tokenizer, resolve_model
from ...models.qwen3_omni.pipeline import thinker_eos_ids
from ...sampling import SamplingParams
from ..base import StageEngine, StepOutput
from ..types import Code2WavPrompt
from .code2wav import Code2WavRunner
from .thinker import ThinkerRunner

log = logging.getLogger(__name__)

_DTYPES = {"auto": torch.float32, "float": torch.float32, "float32": torch.float32,
           "half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16}


def thinker_runner(model, tokenizer) -> ThinkerRunner:
    config = model.config
    return ThinkerRunner(model.thinker, tokenizer, config.talker_config.accept_hidden_layer,
                         thinker_eos_ids(config, tokenizer))


class HfCode2WavEngine(StageEngine):
    """code2wav decodes one request per step, oldest first. Its convolutions are neither
    batch-invariant on CPU (a waveform decoded in a batch of 5 differs in the last bits from the
    same codes decoded alone) nor faster batched (16 utterances of 63 frames: 0.36 s one by one,
    1.36 s as one batch, measured on the 2-core CI machine), so stacking requests would cost
    exactness and time; one request per step still lets new requests and aborts in between."""

    def __init__(self, stage_id: int, model):
        self.stage_id = stage_id
        self.runner = Code2WavRunner(model.code2wav)
        self._waiting: OrderedDict[str, Code2WavPrompt] = OrderedDict()

    def add_request(self, request_id: str, prompt: Code2WavPrompt, params: SamplingParams,
                    stream: bool = False) -> None:
        if request_id in self._waiting:
            raise ValueError(f"request {request_id} is already in stage {self.stage_id}")
        if prompt.codes.dim() != 2:
            raise ValueError(f"request {request_id}: codes must be [num_code_groups, frames], got "
                             f"shape {tuple(prompt.codes.shape)}")
        self._waiting[request_id] = prompt

    def abort_request(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting)

    def request_ids(self) -> list[str]:
        return list(self._waiting)

    def step(self) -> list[StepOutput]:
        request_id, prompt = self._waiting.popitem(last=False)
        try:
            output = self.runner.generate(prompt)
        except Exception as exc:
            return [StepOutput.failed(request_id, f"{type(exc).__name__}: {exc}")]
        return [StepOutput(request_id, finished=True, output=output)]

    def debug_state_counts(self) -> dict[str, int]:
        return {"code2wav.requests": len(self._waiting)}


def build_hf_engine(stage_config, model_name: str) -> StageEngine:
    args = stage_config.engine_args
    model_stage = args.model_stage
    if model_stage not in ("thinker", "talker", "code2wav"):
        raise ValueError(f"stage {stage_config.stage_id}: engine 'hf' runs model_stage thinker, "
                         f"talker or code2wav, not {model_stage!r}")
    name = model_name
    if args.model and args.model != model_name:
        log.warning("stage %d: engine_args.model %r is ignored; every stage runs the model given to "
                    "Omni / --model (%r)", stage_config.stage_id, args.model, model_name)
    dtype = _DTYPES[args.dtype]
    began = time.perf_counter()
    model = load_model(name, load_format="dummy" if args.load_format == "dummy" else "auto",
                       seed=args.seed if args.seed is not None else 0, dtype=dtype)
    log.info("stage %d: hf %s engine ready in %.1f s (model %s, load_format %s)", stage_config.stage_id,
             model_stage, time.perf_counter() - began, name, args.load_format)
    # Each engine keeps references only to the sub-modules it runs (the talker also keeps the
    # thinker's token embedding, for the tts special tokens); the rest is freed with `model`.
    if model_stage == "thinker":
        from .thinker_engine import HfDecodeEngine, HfPrefillEngine, HfThinkerEngine
        runner = thinker_runner(model, load_tokenizer(resolve_model(name)))
        if stage_config.is_prefill_only:
            return HfPrefillEngine(stage_config, runner)
        if stage_config.is_decode_only:
            return HfDecodeEngine(stage_config, runner)
        return HfThinkerEngine(stage_config, runner)
    if model_stage == "talker":
        from .talker_engine import HfTalkerEngine
        return HfTalkerEngine(stage_config.stage_id, model, max_num_seqs=stage_config.max_num_seqs,
                              max_num_batched_tokens=stage_config.max_num_batched_tokens)
    return HfCode2WavEngine(stage_config.stage_id, model)
