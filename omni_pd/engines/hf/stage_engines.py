"""hf (transformers) engines for the three Qwen3-Omni stages."""
from __future__ import annotations

import logging
import warnings

import torch

from ...models.qwen3_omni.factory import load_model, load_tokenizer, resolve_model
from ...sampling import SamplingParams
from ..base import StageEngine
from ..types import (AudioOutput, Code2WavPrompt, TalkerOutput, TalkerPrompt, ThinkerOutput,
                     ThinkerPrompt)
from .code2wav import Code2WavRunner
from .talker import TalkerRunner
from .thinker import ThinkerRunner

log = logging.getLogger(__name__)

_DTYPES = {"auto": torch.float32, "float": torch.float32, "float32": torch.float32,
           "half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16}


def thinker_eos_ids(model_config, tokenizer) -> set[int]:
    ids = {model_config.im_end_token_id}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def thinker_runner(model, tokenizer) -> ThinkerRunner:
    config = model.config
    return ThinkerRunner(model.thinker, tokenizer, config.talker_config.accept_hidden_layer,
                         thinker_eos_ids(config, tokenizer))


class HfThinkerEngine(StageEngine):
    """The whole thinker in one engine (prefill then decode in the same process)."""

    def __init__(self, stage_id: int, model, tokenizer):
        self.stage_id = stage_id
        self.runner = thinker_runner(model, tokenizer)

    def generate(self, request_id: str, prompt: ThinkerPrompt, params: SamplingParams,
                 on_token=None) -> ThinkerOutput:
        pre = self.runner.prefill(prompt, params)
        dec = self.runner.decode(prompt.prompt_token_ids, pre.cache, pre.rope_deltas,
                                 pre.first_token, params, on_token=on_token)
        return ThinkerOutput(
            request_id=request_id, prompt_token_ids=list(prompt.prompt_token_ids),
            token_ids=dec.token_ids, text=dec.text, finish_reason=dec.finish_reason,
            prompt_embeds=pre.prompt_embeds, prompt_hidden=pre.prompt_hidden,
            output_embeds=dec.output_embeds, output_hidden=dec.output_hidden,
            output_start=len(prompt.prompt_token_ids),
            metrics={"first_token_ms": pre.prefill_ms, "prefill_ms": pre.prefill_ms,
                     "decode_ms": dec.decode_ms})


class HfTalkerEngine(StageEngine):
    def __init__(self, stage_id: int, model):
        self.stage_id = stage_id
        self.runner = TalkerRunner(model.talker, model.thinker.get_input_embeddings(), model.config)

    def generate(self, request_id: str, prompt: TalkerPrompt, params: SamplingParams,
                 on_token=None) -> TalkerOutput:
        with warnings.catch_warnings():
            # transformers notes that the penalty skips an embeddings-only prompt; intended here.
            warnings.filterwarnings("ignore", message="Passing `repetition_penalty`")
            return self.runner.generate(prompt, params)


class HfCode2WavEngine(StageEngine):
    def __init__(self, stage_id: int, model):
        self.stage_id = stage_id
        self.runner = Code2WavRunner(model.code2wav)

    def generate(self, request_id: str, prompt: Code2WavPrompt, params: SamplingParams,
                 on_token=None) -> AudioOutput:
        return self.runner.generate(prompt)


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
    model = load_model(name, load_format="dummy" if args.load_format == "dummy" else "auto",
                       seed=args.seed if args.seed is not None else 0, dtype=dtype)
    log.info("stage %d: hf %s engine ready (model %s, load_format %s)", stage_config.stage_id,
             model_stage, name, args.load_format)
    # Each engine keeps references only to the sub-modules it runs (the talker also keeps the
    # thinker's token embedding, for the tts special tokens); the rest is freed with `model`.
    if model_stage == "thinker":
        tokenizer = load_tokenizer(resolve_model(name))
        if stage_config.is_prefill_only or stage_config.is_decode_only:
            from .pd_engines import HfDecodeEngine, HfPrefillEngine
            runner = thinker_runner(model, tokenizer)
            if stage_config.is_prefill_only:
                return HfPrefillEngine(stage_config, runner, args.kv_pool_blocks, args.kv_lease_timeout_s)
            return HfDecodeEngine(stage_config, runner, args.kv_pool_blocks)
        return HfThinkerEngine(stage_config.stage_id, model, tokenizer)
    if model_stage == "talker":
        return HfTalkerEngine(stage_config.stage_id, model)
    return HfCode2WavEngine(stage_config.stage_id, model)
