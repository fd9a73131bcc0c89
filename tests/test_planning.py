"""Pure P/D planning: pair detection, per-side sampling params, N-1 -> N expansion."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from omni_pd.config import PipelineConfig, pipeline_config_from_dict
from omni_pd.planning import (
    PDPair,
    build_decode_sampling_params,
    build_prefill_sampling_params,
    expand_sampling_params,
    find_pd_pair,
    new_transfer_id,
)
from omni_pd.sampling import SamplingParams
from omni_pd.planning.pd import HandoffPolicy, handoff_policy


def _stage(stage_id: int, model_stage: str, sources: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "stage_id": stage_id,
        "engine_args": {"model_stage": model_stage},
        "engine_input_source": sources,
        **extra,
    }


def _kv(role: str, port: int) -> dict[str, Any]:
    return {
        "kv_connector": "MooncakeConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"mooncake_bootstrap_port": port},
    }


def pd_cfg(order: tuple[int, ...] = (0, 1, 2, 3)) -> PipelineConfig:
    """Prefill 10, decode 11, talker 12, code2wav 13, listed in stage_args in `order`."""
    prefill = _stage(10, "thinker", [], is_prefill_only=True)
    prefill["engine_args"]["kv_transfer_config"] = _kv("kv_producer", 25201)
    decode = _stage(11, "thinker", [10], is_decode_only=True, final_output=True)
    decode["engine_args"]["kv_transfer_config"] = _kv("kv_consumer", 25202)
    stages = [
        prefill,
        decode,
        _stage(12, "talker", [10, 11]),
        _stage(13, "code2wav", [12], final_output=True),
    ]
    return pipeline_config_from_dict({"stage_args": [stages[i] for i in order]}, check_imports=False)


def colocated_cfg() -> PipelineConfig:
    return pipeline_config_from_dict(
        {
            "stage_args": [
                _stage(0, "thinker", [], final_output=True),
                _stage(1, "talker", [0]),
                _stage(2, "code2wav", [1], final_output=True),
            ]
        },
        check_imports=False,
    )


USER_SP = SamplingParams(
    temperature=0.7,
    top_k=20,
    max_tokens=128,
    seed=7,
    stop=("</s>",),
    stop_token_ids=(151645,),
    include_stop_str_in_output=True,
    kv_transfer_params={"user_key": [1, 2]},
)


# --- find_pd_pair -------------------------------------------------------------------------------


def test_find_pd_pair() -> None:
    cfg = pd_cfg()
    pair = find_pd_pair(cfg)
    assert isinstance(pair, PDPair)
    assert (pair.prefill_stage_id, pair.decode_stage_id) == (10, 11)
    assert pair.prefill is cfg.stage(10) and pair.decode is cfg.stage(11)


def test_no_pair_in_colocated_pipeline() -> None:
    assert find_pd_pair(colocated_cfg()) is None


def test_ambiguous_pair_built_in_code_is_rejected() -> None:
    cfg = pd_cfg()
    extra = cfg.stage(12).model_copy(update={"is_prefill_only": True})
    broken = cfg.model_copy(update={"stage_args": (*cfg.stage_args[:2], extra, cfg.stage_args[3])})
    with pytest.raises(ValueError, match=r"prefill stages \[10, 12\]"):
        find_pd_pair(broken)


# --- prefill params -----------------------------------------------------------------------------


def test_prefill_params_emit_one_token_and_always_hand_over() -> None:
    before = copy.deepcopy(USER_SP)
    sp = build_prefill_sampling_params(USER_SP, "req-1-xfer-a")
    assert sp.max_tokens == 1
    assert sp.stop == () and sp.stop_token_ids == ()
    assert sp.ignore_eos is True and sp.include_stop_str_in_output is False
    assert sp.kv_transfer_params == {
        "user_key": [1, 2],
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": "req-1-xfer-a",
    }
    # Everything else is the user's.
    assert (sp.temperature, sp.top_k, sp.seed) == (0.7, 20, 7)
    assert USER_SP == before and USER_SP.kv_transfer_params == {"user_key": [1, 2]}
    assert sp.kv_transfer_params is not USER_SP.kv_transfer_params


def test_prefill_params_without_user_kv_params() -> None:
    sp = build_prefill_sampling_params(SamplingParams(max_tokens=5), "t")
    assert sp.kv_transfer_params == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "t"}


# --- decode params ------------------------------------------------------------------------------

PREFILL_OUT = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "engine-p",
    "remote_bootstrap_addr": "10.0.0.1:25201",
    "remote_request_id": "req-1-prefill",
    "transfer_id": "req-1-xfer-a",
    "omni_pd_block_ids": [3, 4, 9],
}


def test_decode_params_carry_prefill_output_and_user_params() -> None:
    sp_before, out_before = copy.deepcopy(USER_SP), copy.deepcopy(PREFILL_OUT)
    sp = build_decode_sampling_params(USER_SP, PREFILL_OUT, "req-1-xfer-a")
    assert sp.kv_transfer_params == {
        "user_key": [1, 2],
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "engine-p",
        "remote_bootstrap_addr": "10.0.0.1:25201",
        "remote_request_id": "req-1-prefill",
        "transfer_id": "req-1-xfer-a",
        "omni_pd_block_ids": [3, 4, 9],
    }
    # The user's generation settings survive on the decode side.
    assert (sp.max_tokens, sp.stop, sp.stop_token_ids, sp.ignore_eos) == (128, ("</s>",), (151645,), False)
    assert USER_SP == sp_before and PREFILL_OUT == out_before


def test_decode_flags_override_whatever_prefill_returned() -> None:
    out = {**PREFILL_OUT, "do_remote_prefill": False, "do_remote_decode": True}
    kv = build_decode_sampling_params(SamplingParams(), out, "req-1-xfer-a").kv_transfer_params
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False


@pytest.mark.parametrize("missing", ["remote_engine_id", "remote_bootstrap_addr", "remote_request_id"])
def test_decode_params_need_routing_keys(missing: str) -> None:
    out = {k: v for k, v in PREFILL_OUT.items() if k != missing}
    with pytest.raises(ValueError, match=rf"req-1-xfer-a.*{missing}"):
        build_decode_sampling_params(USER_SP, out, "req-1-xfer-a")


def test_decode_params_treat_none_as_missing() -> None:
    with pytest.raises(ValueError, match="remote_engine_id"):
        build_decode_sampling_params(USER_SP, {**PREFILL_OUT, "remote_engine_id": None}, "req-1-xfer-a")


def test_decode_params_without_prefill_kv_params() -> None:
    with pytest.raises(ValueError, match="req-9.*no kv_transfer_params"):
        build_decode_sampling_params(USER_SP, None, "req-9")


def test_decode_params_reject_another_transfers_output() -> None:
    with pytest.raises(ValueError, match="belongs to transfer req-1-xfer-a"):
        build_decode_sampling_params(USER_SP, PREFILL_OUT, "req-2-xfer-b")


# --- expand_sampling_params ---------------------------------------------------------------------

THINKER, TALKER, C2W = (SamplingParams(max_tokens=n, kv_transfer_params={"n": n}) for n in (11, 22, 33))


def test_expand_duplicates_thinker_entry_for_decode() -> None:
    params = [THINKER, TALKER, C2W]
    before = copy.deepcopy(params)
    out = expand_sampling_params(params, pd_cfg())
    assert out == [THINKER, THINKER, TALKER, C2W]
    assert out[1] is not THINKER and out[1].kv_transfer_params is not THINKER.kv_transfer_params
    assert params == before and len(params) == 3


def test_expand_keeps_none_meaning_stage_defaults() -> None:
    assert expand_sampling_params([None, TALKER, None], pd_cfg()) == [None, None, TALKER, None]


def test_expand_follows_stage_order_in_file() -> None:
    # stage_args order: talker(12), decode(11), prefill(10), code2wav(13)
    cfg = pd_cfg(order=(2, 1, 0, 3))
    out = expand_sampling_params([TALKER, THINKER, C2W], cfg)
    assert out == [TALKER, THINKER, THINKER, C2W]


def test_expand_passes_full_list_through_as_copy() -> None:
    params = [THINKER, SamplingParams(max_tokens=3), TALKER, C2W]
    out = expand_sampling_params(params, pd_cfg())
    assert out == params and out is not params


def test_expand_without_pair_needs_one_per_stage() -> None:
    cfg = colocated_cfg()
    assert expand_sampling_params([THINKER, TALKER, C2W], cfg) == [THINKER, TALKER, C2W]
    with pytest.raises(ValueError, match="expected 3 sampling params.*got 2"):
        expand_sampling_params([THINKER, TALKER], cfg)


@pytest.mark.parametrize("count", [0, 2, 5])
def test_expand_wrong_length_says_what_is_expected(count: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"expected 3 sampling params .*prefill stage 10 and decode stage 11 share one entry.* or 4 .*got {count}",
    ):
        expand_sampling_params([THINKER] * count, pd_cfg())


# --- transfer ids -------------------------------------------------------------------------------


def test_new_transfer_id_is_unique_and_names_request() -> None:
    ids = {new_transfer_id("chatcmpl-42") for _ in range(100)}
    assert len(ids) == 100
    assert all(t.startswith("chatcmpl-42") for t in ids)


# --- handoff policy -----------------------------------------------------------------------------


def _with_extra(prefill: dict[str, Any], decode: dict[str, Any]) -> PipelineConfig:
    cfg = pd_cfg()
    stages = []
    for stage, extra in ((cfg.stage(10), prefill), (cfg.stage(11), decode)):
        kv = stage.kv_transfer_config
        merged = {**kv.kv_connector_extra_config.model_dump(exclude_unset=True), **extra}
        kv = kv.model_copy(update={"kv_connector_extra_config": type(kv.kv_connector_extra_config)(**merged)})
        stages.append(
            stage.model_copy(
                update={"engine_args": stage.engine_args.model_copy(update={"kv_transfer_config": kv})}
            )
        )
    return cfg.model_copy(update={"stage_args": (*stages, cfg.stage(12), cfg.stage(13))})


def test_handoff_policy_defaults() -> None:
    assert handoff_policy(find_pd_pair(pd_cfg())) == HandoffPolicy(
        miss_window_s=5.0,
        deadline_s=10.0,
        breaker_threshold=3,
        breaker_cooldown_s=5.0,
        fallback="local_prefill",
    )


def test_handoff_policy_reads_the_decode_stage() -> None:
    cfg = _with_extra(
        {},
        {
            "kv_miss_window_s": 1.5,
            "kv_handoff_deadline_s": 2.0,
            "kv_breaker_threshold": 7,
            "kv_breaker_cooldown_s": 0.25,
            "kv_fallback": "error",
        },
    )
    policy = handoff_policy(find_pd_pair(cfg))
    assert policy == HandoffPolicy(1.5, 2.0, 7, 0.25, "error")
    with pytest.raises(Exception):  # frozen
        policy.miss_window_s = 3.0  # type: ignore[misc]


def test_handoff_policy_ignores_the_prefill_stage() -> None:
    # The loader refuses a contradicting prefill stage; a config built in code still gets the
    # decode stage's values.
    cfg = _with_extra({"kv_miss_window_s": 1.0}, {})
    assert handoff_policy(find_pd_pair(cfg)).miss_window_s == 5.0
