"""The thinker split in two: a prefill engine that publishes the prompt's KV in registered blocks,
and a decode engine that fetches those blocks over Mooncake and generates from them."""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import torch
from transformers import DynamicCache

from ...kv import BlockLayout, KVDescriptor, KVReceiver, KVSender, MooncakeTransport
from ...sampling import SamplingParams
from ..base import StageEngine
from ..types import ThinkerOutput, ThinkerPrompt
from .thinker import ThinkerRunner

log = logging.getLogger(__name__)

_TORCH_TO_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def cache_to_canonical(cache: DynamicCache) -> torch.Tensor:
    """[layers, 2, kv_heads, tokens, head_dim] from a batch-of-one DynamicCache."""
    return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])


def canonical_to_cache(kv: torch.Tensor, text_config) -> DynamicCache:
    cache = DynamicCache(config=text_config)
    for index in range(kv.shape[0]):
        cache.update(kv[index, 0].unsqueeze(0).contiguous(), kv[index, 1].unsqueeze(0).contiguous(), index)
    return cache


def thinker_layout(thinker, block_size: int) -> BlockLayout:
    text = thinker.config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dtype = _TORCH_TO_NAME[next(thinker.parameters()).dtype]
    return BlockLayout.default_for(text.num_hidden_layers, text.num_key_value_heads, head_dim,
                                   dtype, block_size=block_size)


def _kv_settings(stage_config) -> tuple[str, str]:
    kv = stage_config.kv_transfer_config
    extra = kv.kv_connector_extra_config if kv else None
    protocol = (extra.mooncake_protocol if extra and extra.mooncake_protocol else "tcp")
    host = (kv.kv_ip if kv and kv.kv_ip else "127.0.0.1")
    return host, protocol


class HfPrefillEngine(StageEngine):
    control_calls = frozenset({"debug_state_counts", "release_kv", "inject_kv_fault"})

    def __init__(self, stage_config, runner: ThinkerRunner, pool_blocks: int, lease_timeout_s: float):
        self.stage_id = stage_config.stage_id
        self.runner = runner
        kv = stage_config.kv_transfer_config
        self.engine_id = (kv.engine_id if kv and kv.engine_id else f"prefill-{uuid.uuid4().hex[:12]}")
        host, protocol = _kv_settings(stage_config)
        self.transport = MooncakeTransport(host=host, protocol=protocol)
        self.layout = thinker_layout(runner.thinker, stage_config.engine_args.kv_block_size)
        self.sender = KVSender(self.engine_id, self.layout, pool_blocks, self.transport, lease_timeout_s)

    def describe(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "kv_session": self.transport.session_id,
                "kv_layout": self.layout.to_dict()}

    def generate(self, request_id: str, prompt: ThinkerPrompt, params: SamplingParams,
                 on_token=None) -> ThinkerOutput:
        kv_params = params.kv_transfer_params or {}
        if not kv_params.get("do_remote_decode") or not kv_params.get("transfer_id"):
            raise ValueError(f"request {request_id}: a prefill-only stage needs kv_transfer_params "
                             "with do_remote_decode=true and a transfer_id (the orchestrator's "
                             "P/D planning sets them)")
        transfer_id = kv_params["transfer_id"]
        pre = self.runner.prefill(prompt, params)
        descriptor = self.sender.publish(transfer_id, cache_to_canonical(pre.cache))
        out_params = {
            **descriptor.to_params(),
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_bootstrap_addr": f"mooncake://{self.transport.session_id}",
            "remote_request_id": request_id,
            "first_token": pre.first_token,
            "rope_deltas": pre.rope_deltas,
        }
        log.debug("request %s: published %d prompt tokens as transfer %s", request_id,
                  len(prompt.prompt_token_ids), transfer_id)
        return ThinkerOutput(
            request_id=request_id, prompt_token_ids=list(prompt.prompt_token_ids),
            token_ids=[pre.first_token], text="", finish_reason="length",
            prompt_embeds=pre.prompt_embeds, prompt_hidden=pre.prompt_hidden,
            output_start=len(prompt.prompt_token_ids), kv_transfer_params=out_params,
            metrics={"first_token_ms": pre.prefill_ms, "prefill_ms": pre.prefill_ms})

    def release_kv(self, transfer_id: str) -> bool:
        return self.sender.release(transfer_id)

    def inject_kv_fault(self, block_index: int = 0, byte_offset: int = 3) -> None:
        self.sender.inject_fault_once(block_index, byte_offset)

    def housekeeping(self) -> None:
        self.sender.expire_leases()

    def debug_state_counts(self) -> dict[str, int]:
        return self.sender.debug_state_counts()

    def close(self) -> None:
        self.sender.close()


class HfDecodeEngine(StageEngine):
    def __init__(self, stage_config, runner: ThinkerRunner, pool_blocks: int):
        self.stage_id = stage_config.stage_id
        self.runner = runner
        host, protocol = _kv_settings(stage_config)
        self.transport = MooncakeTransport(host=host, protocol=protocol)
        self.layout = thinker_layout(runner.thinker, stage_config.engine_args.kv_block_size)
        self.receiver = KVReceiver(self.layout, pool_blocks, self.transport)

    def describe(self) -> dict[str, Any]:
        return {"kv_session": self.transport.session_id, "kv_layout": self.layout.to_dict()}

    def generate(self, request_id: str, prompt: ThinkerPrompt, params: SamplingParams,
                 on_token=None) -> ThinkerOutput:
        began = time.perf_counter()
        kv_params = params.kv_transfer_params or {}
        if not kv_params.get("do_remote_prefill"):
            raise ValueError(f"request {request_id}: a decode-only stage needs kv_transfer_params "
                             "with do_remote_prefill=true from a prefill stage")
        descriptor = KVDescriptor.from_params(kv_params)
        prompt_len = len(prompt.prompt_token_ids)
        if descriptor.num_tokens != prompt_len:
            raise ValueError(f"request {request_id}: transfer {descriptor.transfer_id} holds KV for "
                             f"{descriptor.num_tokens} tokens but the prompt has {prompt_len}")
        fetched = self.receiver.fetch(descriptor)
        cache = canonical_to_cache(fetched.kv, self.runner.text_config)
        ready_ms = (time.perf_counter() - began) * 1e3
        dec = self.runner.decode(prompt.prompt_token_ids, cache, int(kv_params["rope_deltas"]),
                                 int(kv_params["first_token"]), params, on_token=on_token)
        return ThinkerOutput(
            request_id=request_id, prompt_token_ids=list(prompt.prompt_token_ids),
            token_ids=dec.token_ids, text=dec.text, finish_reason=dec.finish_reason,
            output_embeds=dec.output_embeds, output_hidden=dec.output_hidden,
            output_start=prompt_len, num_cached_prompt_tokens=prompt_len,
            metrics={"first_token_ms": ready_ms, "decode_ms": dec.decode_ms,
                     "kv_transfer_ms": fetched.transfer_ms,
                     "kv_bytes_transferred": fetched.bytes_transferred})

    def debug_state_counts(self) -> dict[str, int]:
        return self.receiver.debug_state_counts()

    def close(self) -> None:
        self.receiver.close()
