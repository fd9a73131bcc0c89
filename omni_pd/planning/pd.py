"""Pure prefill/decode planning: find the P/D pair, derive per-side sampling params.

No I/O, no processes, no mutation: every function returns new objects and leaves its arguments
(including any `kv_transfer_params` dict) untouched. kv_transfer_params use vLLM's key names;
omni-pd's own keys travel beside them and are never renamed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from omni_pd.config.schema import KVConnectorExtraConfig, PipelineConfig, StageConfig
from omni_pd.sampling import SamplingParams

# Keys the decode side needs from the prefill output to find and pull the KV cache (vLLM names).
REQUIRED_PREFILL_OUTPUT_KEYS: tuple[str, ...] = (
    "remote_engine_id",
    "remote_bootstrap_addr",
    "remote_request_id",
)


@dataclass(frozen=True)
class PDPair:
    prefill_stage_id: int
    decode_stage_id: int
    prefill: StageConfig
    decode: StageConfig


def find_pd_pair(cfg: PipelineConfig) -> PDPair | None:
    """The single prefill/decode pair, or None. Raises ValueError for an ambiguous pipeline
    (the loader rejects those; this guards configs built in code)."""
    prefill = [s for s in cfg.stages if s.is_prefill_only]
    decode = [s for s in cfg.stages if s.is_decode_only]
    if not prefill and not decode:
        return None
    if len(prefill) != 1 or len(decode) != 1 or prefill[0] is decode[0]:
        raise ValueError(
            "expected exactly one is_prefill_only stage and one distinct is_decode_only stage, got "
            f"prefill stages {[s.stage_id for s in prefill]} and decode stages {[s.stage_id for s in decode]}"
        )
    return PDPair(prefill[0].stage_id, decode[0].stage_id, prefill[0], decode[0])


@dataclass(frozen=True)
class HandoffPolicy:
    """How a P/D pair's KV handoff meets faults (the decode stage's kv_connector_extra_config)."""

    miss_window_s: float  # the decode side's wait for a request's KV
    deadline_s: float  # hard bound on one handoff
    breaker_threshold: int  # consecutive handoff failures that open the breaker to the peer
    breaker_cooldown_s: float  # how long an open breaker stays open
    fallback: str  # "local_prefill" | "error": what a request does when its handoff fails
    transfer_mode: str = "pull"  # "push": the decode side reserves blocks the prefill writes


# HandoffPolicy field -> its kv_connector_extra_config key.
HANDOFF_POLICY_KEYS: dict[str, str] = dict(
    zip(
        (
            "miss_window_s",
            "deadline_s",
            "breaker_threshold",
            "breaker_cooldown_s",
            "fallback",
            "transfer_mode",
        ),
        KVConnectorExtraConfig.HANDOFF_KEYS,
    )
)


def handoff_policy(pair: PDPair) -> HandoffPolicy:
    """The pair's policy: the decode stage's keys (defaults where it sets none). The loader
    refuses a prefill stage that sets one of them to another value."""
    kv = pair.decode.kv_transfer_config
    extra = kv.kv_connector_extra_config if kv is not None else KVConnectorExtraConfig()
    return HandoffPolicy(**{name: getattr(extra, key) for name, key in HANDOFF_POLICY_KEYS.items()})


def new_transfer_id(request_id: str) -> str:
    """A transfer id unique per attempt that still shows which request it belongs to."""
    return f"{request_id}-xfer-{uuid.uuid4().hex}"


def build_prefill_sampling_params(sp: SamplingParams, transfer_id: str) -> SamplingParams:
    """Run the prompt, emit exactly one token and always publish the KV cache.

    Stop strings, stop ids and EOS are neutralised so that an end-of-sequence first token cannot
    finish the request before the handoff; the decode side applies the user's stop conditions.
    """
    kv = {
        **(sp.kv_transfer_params or {}),
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    return sp.replace(
        max_tokens=1,
        stop=(),
        stop_token_ids=(),
        include_stop_str_in_output=False,
        ignore_eos=True,
        kv_transfer_params=kv,
    )


def build_decode_sampling_params(
    sp: SamplingParams, prefill_kv_params: Mapping[str, Any] | None, transfer_id: str
) -> SamplingParams:
    """The user's sampling params plus the kv_transfer_params that pull the prefill's KV cache.

    Every key the prefill output returned is carried over (omni-pd's block-table keys included);
    the three routing keys are required, and the direction flags and transfer id are set here.
    """
    if prefill_kv_params is None:
        raise ValueError(f"transfer {transfer_id}: the prefill output carried no kv_transfer_params")
    missing = [k for k in REQUIRED_PREFILL_OUTPUT_KEYS if prefill_kv_params.get(k) is None]
    if missing:
        raise ValueError(
            f"transfer {transfer_id}: prefill output kv_transfer_params lack required key(s) "
            f"{missing}; got keys {sorted(prefill_kv_params)}"
        )
    returned_id = prefill_kv_params.get("transfer_id")
    if returned_id is not None and returned_id != transfer_id:
        # A mismatch means a prefill output was routed to the wrong request.
        raise ValueError(f"transfer {transfer_id}: prefill output belongs to transfer {returned_id}")
    kv = {
        **(sp.kv_transfer_params or {}),
        **prefill_kv_params,
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
    }
    return sp.replace(kv_transfer_params=kv)


def expand_sampling_params(
    params: Sequence[SamplingParams | None], cfg: PipelineConfig
) -> list[SamplingParams | None]:
    """Per-logical-stage params -> per-stage params, in stage_args order.

    With a P/D pair, users see the thinker as one stage and pass N-1 entries; the prefill stage's
    entry is duplicated for the decode stage at the decode stage's position. N entries are
    returned as a new list unchanged. A None entry ("use the stage's defaults") is duplicated as
    None.
    """
    stage_ids = cfg.stage_ids
    pair = find_pd_pair(cfg)
    if len(params) == len(stage_ids):
        return list(params)
    if pair is None:
        raise ValueError(
            f"expected {len(stage_ids)} sampling params (one per stage {list(stage_ids)}), got {len(params)}"
        )
    logical = [sid for sid in stage_ids if sid != pair.decode_stage_id]
    if len(params) != len(logical):
        raise ValueError(
            f"expected {len(logical)} sampling params (one per logical stage {logical}; prefill stage "
            f"{pair.prefill_stage_id} and decode stage {pair.decode_stage_id} share one entry) or "
            f"{len(stage_ids)} (one per stage {list(stage_ids)}), got {len(params)}"
        )
    by_stage = dict(zip(logical, params))
    # replace() builds a distinct object with its own kv_transfer_params dict for the decode stage.
    thinker = by_stage[pair.prefill_stage_id]
    by_stage[pair.decode_stage_id] = thinker.replace() if thinker is not None else None
    return [by_stage[sid] for sid in stage_ids]
