"""`bench roofline`'s speech rows for a Qwen2.5-Omni checkpoint (the thinker's rows are the shared
ones): its talker step and one token2wav window, through the runners the engines call.

  talker_step      one talker step of `batch` requests (`context` positions cached): a codec
                   code each, 20 ms of speech (codes at 50 Hz)
  code2wav_chunk   one token2wav window in steady state: 36 codes (72 mel frames, 0.72 s), its
                   DiT integrated over the window and its context (48 frames before, 24 after),
                   `token2wav_num_steps` RK4 steps with guidance, then BigVGAN over the window

What a step must read: the talker's weights outside its codec embedding (one row of it a
request) plus the KV it attends to; token2wav's DiT once per evaluation (counted), BigVGAN once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..engines.core.ar_engine import decode_attention
from ..engines.core.request import EngineRequest
from ..sampling import SamplingParams

CODE_S = 0.02  # one talker code: 20 ms of speech (50 Hz; token2wav repeats each for 2 mel frames)
WINDOW_CODES = 36  # one token2wav window (72 mel frames)


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _load(bench: Any, stage: str):
    from ..models.qwen2_5_omni.factory import load_speakers, load_stage, resolve_model

    parts, _ = load_stage(bench.checkpoint, stage, dtype=bench.dtype)
    return parts, load_speakers(resolve_model(bench.checkpoint))


def talker(bench: Any, batches: list[int], context: int, block: int) -> None:
    """One row per batch; `block`: the KV block size of the bench's caches."""
    from ..models.qwen2_5_omni.hf.talker_runner import TalkerRunner, TalkerState, Voices

    parts, speakers = _load(bench, "talker")
    module = parts.require("talker").to(bench.device)
    runner = TalkerRunner(
        module, parts.require("thinker_embedding").to(bench.device), Voices(speakers), bench.kernels
    )
    layout = runner.kv_layout(block)
    width = runner.config.embedding_size
    codebook = runner.config.tts_codec_pad_token_id  # the codes below the control ids
    embedding = module.model.embed_tokens
    touched = _param_bytes(module) - _param_bytes(embedding)
    for batch in batches:
        cache = bench._cache(layout, batch, context + 64)
        requests = []
        for b in range(batch):
            g = torch.Generator().manual_seed(b)
            state = TalkerState(
                inputs=torch.zeros(1, width, dtype=bench.dtype, device=bench.device),
                reply=torch.randn(64, width, generator=g).to(bench.dtype).to(bench.device),
            )
            r = EngineRequest(
                f"t{b}", None, SamplingParams(temperature=0.9, top_k=40, seed=b), context, None, model=state
            )
            r.tokens = [b % codebook]
            r.blocks = cache.allocate(context + 64)
            requests.append(r)
        ms, _, flops = bench._measure(
            lambda: runner.decode(requests, decode_attention(runner, cache, requests))
        )
        row_bytes = embedding.embedding_dim * embedding.weight.element_size()
        nbytes = touched + batch * row_bytes + batch * context * layout.bytes_per_token
        bench._add("talker_step", batch, 1, context, len(module.model.layers), ms, nbytes, flops)
        for r in requests:
            cache.release(r.blocks)


def token2wav(bench: Any, num_steps: int = 10) -> None:
    from ..models.qwen2_5_omni.hf.token2wav import Token2Wav, WindowedStream, conditioning
    from ..models.qwen2_5_omni.tiny_config import DEFAULT_VOICE

    parts, speakers = _load(bench, "code2wav")
    module = parts.require("token2wav").float().to(bench.device)
    t2w = Token2Wav(module, seed=0, num_steps=num_steps)
    codes = torch.randint(
        0, t2w.dit.config.num_embeds - 1, (3 * WINDOW_CODES,), generator=torch.Generator().manual_seed(0)
    )
    with bench._default_device():
        first = WindowedStream(conditioning(speakers, DEFAULT_VOICE))
        # The first window (and its look-ahead) decoded: the timed window is a steady-state one.
        t2w.feed(first, codes[: WINDOW_CODES + 12].tolist(), final=False)
    second = codes[WINDOW_CODES + 12 : 2 * WINDOW_CODES + 12].tolist()

    def window() -> torch.Tensor:
        stream = dataclasses.replace(first, codes=list(first.codes))
        audio = t2w.feed(stream, second, final=False)
        assert stream.windows == first.windows + 1, "one window a step"
        return audio

    ms, _, flops = bench._measure(window)
    # RK4 over `num_steps` times: 4 evaluations an interval, each one DiT pass (guided and free
    # rows in one batch of 2) that reads its weights.
    evaluations = 4 * (num_steps - 1)
    nbytes = evaluations * _param_bytes(t2w.dit) + _param_bytes(t2w.vocoder)
    layers = len(t2w.dit.transformer_blocks)
    bench._add("code2wav_chunk[torch]", 1, WINDOW_CODES, 0, layers, ms, nbytes, flops)
