"""Fix (e): a decode request can say how many of its prompt tokens the prefill engine computed.

Upstream (vLLM 0.32.0, `MooncakeConnectorScheduler.get_num_new_matched_tokens`): a decode
request with `do_remote_prefill` loads KV for its whole prompt. The prefill engine computed the
prompt and sampled the first token, but a decode request whose prompt is the prompt alone has all
its KV loaded, so vLLM's scheduler computes the last prompt position again to get logits and
samples the first token a second time: the second token costs a whole extra step after the
handoff.

Patched: a decode request whose `kv_transfer_params` carry `omni_pd_remote_tokens` (an int) loads
KV for that many prompt tokens, not for its whole prompt. omni-pd's vLLM engine sends the prompt
plus the prefill's first token as the decode request's prompt and `omni_pd_remote_tokens` = the
prompt's length: the KV covers the prompt, and the first step computes the first token's position
and samples the second token (engines/vllm/resume.py). Requests without the key load as upstream.
"""

from __future__ import annotations

import inspect

from ._guard import Patch, mark_patched

SUPPORTED = ("0.32.0",)
REMOTE_TOKENS_KEY = "omni_pd_remote_tokens"


def _install() -> str | None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    cls = mc.MooncakeConnectorScheduler
    source = inspect.getsource(cls.get_num_new_matched_tokens)
    if "_get_remote_prefill_token_count(len(token_ids))" not in source:
        return "MooncakeConnectorScheduler.get_num_new_matched_tokens no longer counts the whole prompt"
    original = cls.get_num_new_matched_tokens

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params
        remote = params.get(REMOTE_TOKENS_KEY) if params else None
        if not params or not params.get("do_remote_prefill") or type(remote) is not int:
            return original(self, request, num_computed_tokens)
        count = remote - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    mark_patched(cls, "get_num_new_matched_tokens", get_num_new_matched_tokens)
    return None


PATCH = Patch(
    name="decode_resume",
    what="MooncakeConnector decode requests load KV for omni_pd_remote_tokens prompt tokens when "
    "they carry it (the prompt plus the prefill's first token: no recomputed position)",
    supported=SUPPORTED,
    install=_install,
)
