"""A vLLM decode leg that starts from the prefill leg's first token, as the hf decode leg does.

The prefill leg computed the prompt and sampled the first token; its KV covers the prompt. A
decode request whose prompt is the prompt alone makes vLLM compute the last prompt position again
and sample the first token a second time: one wasted step before the second token. Instead the
decode request's prompt is the prompt plus that first token, and `omni_pd_remote_tokens` (the
decode_resume fix) says the KV covers the prompt only, so vLLM's first step computes the first
token's position and samples the second. The engine puts the first token back in front of vLLM's
output, so callers see the same tokens, rows and text as before.

Where that would change the answer, the leg takes vLLM's way (recompute the last position):
- the first token ends the request (a stop token, or EOS unless `ignore_eos`), or `max_tokens`
  is 1: there is nothing to decode;
- stop strings: vLLM looks for them in the output's text only, and one that begins inside the
  first token's text would be missed;
- seeded sampling (a seed and temperature > 0): vLLM draws one number per sampled token from the
  request's generator, so skipping the first token's draw would change every token after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...sampling import SamplingParams
from .patches.decode_resume import REMOTE_TOKENS_KEY

FIRST_TOKEN_KEY = "first_token"  # what both prefill engines put in their kv_transfer_params


@dataclass(frozen=True)
class Resume:
    """A decode leg that starts from the prefill's first token."""

    first_token: int
    prompt_tokens: int  # the prompt's length: what the transferred KV covers

    def vllm_prompt(self, prompt: dict[str, Any]) -> dict[str, Any]:
        """vLLM's prompt with the first token after the prompt (trailing text tokens: a
        multimodal prompt's placeholders, which vLLM expands, are all before it)."""
        return {**prompt, "prompt_token_ids": [*prompt["prompt_token_ids"], self.first_token]}

    def params(self, params: SamplingParams) -> SamplingParams:
        """One token fewer for vLLM to sample, and the KV's extent for the connector."""
        kv = {**(params.kv_transfer_params or {}), REMOTE_TOKENS_KEY: self.prompt_tokens}
        return params.replace(max_tokens=params.max_tokens - 1, kv_transfer_params=kv)


def resume_from(
    kv_in: dict[str, Any], params: SamplingParams, prompt_tokens: int, eos_ids: frozenset[int]
) -> Resume | None:
    """How this decode leg starts from the prefill's first token; None: vLLM's way (the module
    docstring says when)."""
    first = kv_in.get(FIRST_TOKEN_KEY)
    if type(first) is not int or params.max_tokens <= 1 or params.stop:
        return None
    if params.seed is not None and params.temperature > 0:
        return None
    if first in params.stop_token_ids or (not params.ignore_eos and first in eos_ids):
        return None
    return Resume(first_token=first, prompt_tokens=prompt_tokens)


def eos_token_ids(engine: Any) -> frozenset[int]:
    """The ids that end a request unless `ignore_eos`, as vLLM's input processor adds them to
    every request (the tokenizer's EOS and the generation config's)."""
    processor = engine.input_processor
    ids: set[int] = set()
    primary = processor.renderer.get_eos_token_id()
    if primary is not None:
        ids.add(int(primary))
    more = (processor.generation_config_fields or {}).get("eos_token_id")
    if more is not None:
        ids.update([more] if isinstance(more, int) else more)
    return frozenset(ids)
