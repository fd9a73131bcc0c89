"""A chat request prepared for the stages: translated (its audio decoded), its prompt built and
its length checked, in a thread unless it is short text."""

from __future__ import annotations

import asyncio
from typing import Any

from ...orchestrator.async_omni import AsyncOmni, PreparedPrompt, PromptTooLong
from .errors import as_api_error
from .protocol import APIError, ChatCompletionRequest
from .server_state import ServerState
from .translate import TranslatedRequest, translate

# Text longer than this many characters per token of context is tokenized only up to that many
# characters at first: more tokens than the context there already refuses the request, after a
# bounded amount of work (tokenizing the 16 MiB a body may hold takes about 20 s of CPU).
PREFIX_CHARS_PER_TOKEN = 64


def _texts(prompt: dict[str, Any]) -> list[str]:
    out = []
    for message in prompt["messages"]:
        content = message["content"]
        if isinstance(content, str):
            out.append(content)
        else:
            out.extend(part["text"] for part in content if part["type"] == "text")
    return out


# Text up to this many characters, with no audio, is prepared on the event loop (~0.1 ms): the
# thread hop costs more under load, where the thread waits for the GIL behind the loop.
INLINE_PREPARE_CHARS = 4096


def prepare_inline(body: ChatCompletionRequest) -> bool:
    """Whether `body` is short text only, cheaper to prepare on the event loop than in a thread."""
    chars = 0
    for message in body.messages:
        content = message.content
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        for part in parts:
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                return False  # audio to decode, or a malformed part: the thread reports it
            chars += len(text)
    return chars <= INLINE_PREPARE_CHARS


def _prepare(
    omni: AsyncOmni, body: ChatCompletionRequest, served_model: str
) -> tuple[TranslatedRequest, PreparedPrompt]:
    """The request translated (its audio decoded), its prompt built and its length checked: CPU
    work that runs in a thread, off the event loop (a 20 MB text took 26 s to tokenize on it, and
    the server answered nothing meanwhile, /health included), unless `prepare_inline`. Checked
    here so a streamed request that cannot fit gets a 400 before its response starts; the built
    prompt goes to the stages."""
    thinker_defaults = omni.stages[omni.text_stage_id].default_sampling_params
    request = translate(body, thinker_defaults, served_model)
    max_tokens, context = request.thinker_params.max_tokens, omni.max_model_len
    texts, cap = _texts(request.prompt), PREFIX_CHARS_PER_TOKEN * context
    if sum(map(len, texts)) > cap:
        # Each text tokenized on its own: in the prompt it is at most a token shorter at either
        # end (where it merges with the chat template's text around it).
        lower_bound = 0
        for text in texts:
            lower_bound += len(omni.tokenizer.encode(text[:cap], add_special_tokens=False)) - 2
            if lower_bound + max_tokens > context:
                raise PromptTooLong.of(lower_bound, max_tokens, context, at_least=True)
    prepared = omni.prepare(request.prompt)
    prompt_len = len(prepared.text_prompt.prompt_token_ids)
    if prompt_len + max_tokens > context:
        raise PromptTooLong.of(prompt_len, max_tokens, context)
    return request, prepared


async def prepare_checked(
    state: ServerState, omni: AsyncOmni, body: ChatCompletionRequest
) -> tuple[TranslatedRequest, PreparedPrompt]:
    """The request checked, translated and its prompt built; any refusal as an API error."""
    if body.modalities is None and state.default_modalities != ("text",):
        body = body.model_copy(update={"modalities": list(state.default_modalities)})
    try:
        if body.audio is not None and body.audio.voice.lower() not in omni.pipeline.voices:
            raise APIError(
                400,
                f"voice {body.audio.voice!r} is not available; choose one of {list(omni.pipeline.voices)}",
                param="audio.voice",
            )
        if prepare_inline(body):
            return _prepare(omni, body, state.served_model)
        return await asyncio.to_thread(_prepare, omni, body, state.served_model)
    except BaseException as exc:
        raise as_api_error(state, exc) from exc
