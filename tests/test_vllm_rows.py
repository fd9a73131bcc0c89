"""The generic pieces of the vLLM row recording, without a vLLM engine: how a pass's rows are
split by request, how a request's rows are kept by position, and the version guard."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omni_pd.engines.vllm.hooks import VllmModelHooks
from omni_pd.engines.vllm.engine import _with_model_kwargs
from omni_pd.engines.vllm.rows import EXTENSION, ROWS_ARG, RequestRows, RowSink, check_vllm_version


def _runner(req_ids, bounds, computed, extra_args=None):
    """vLLM's model runner as the sink reads it: the pass's batch, and each request's sampling
    params (their extra_args)."""
    batch = SimpleNamespace(req_ids=req_ids, num_computed_tokens_cpu=np.array(computed))
    requests = {
        r: SimpleNamespace(sampling_params=SimpleNamespace(extra_args=(extra_args or {}).get(r)))
        for r in req_ids
    }
    return SimpleNamespace(
        input_batch=batch, query_start_loc=SimpleNamespace(np=np.array(bounds)), requests=requests
    )


def test_a_pass_is_split_by_request_and_placed_by_position():
    runner = _runner(["a-1", "b-2"], [0, 3, 4, 4], [0, 7])  # a prefills 3, b decodes 1 at 7
    sink = RowSink(runner)
    rows = torch.arange(8.0).reshape(4, 2)
    sink.record(rows, -rows)
    taken = sink.take()
    assert [start for start, _ in taken["a-1"]] == [0] and [s for s, _ in taken["b-2"]] == [7]
    assert torch.equal(taken["a-1"][0][1][0], rows[:3]) and torch.equal(taken["b-2"][0][1][1], -rows[3:])
    assert sink.take() == {}  # taken once


def test_a_request_whose_rows_nobody_reads_records_none():
    """A text-only request (extra_args omni_pd_rows False) records nothing; the other request
    of the same pass keeps its rows (the control)."""
    runner = _runner(["a-1", "b-2"], [0, 3, 4], [0, 7], {"a-1": {ROWS_ARG: False}})
    sink = RowSink(runner)
    sink.record(torch.arange(8.0).reshape(4, 2))
    assert list(sink.take()) == ["b-2"]


def test_a_pass_with_fewer_rows_than_tokens_is_an_error():
    sink = RowSink(_runner(["a"], [0, 5], [0]))
    with pytest.raises(RuntimeError, match=r"recorded \[3\] rows for a pass of 5 scheduled tokens"):
        sink.record(torch.zeros(3, 2))


def test_rows_are_kept_by_position_and_a_recomputed_position_keeps_its_latest():
    rows = RequestRows()
    rows.add(0, (torch.tensor([[0.0], [1.0], [2.0]]),))
    rows.add(2, (torch.tensor([[20.0], [3.0]]),))  # position 2 computed again, then 3
    (column,) = rows.span(0, 4)
    assert column.flatten().tolist() == [0.0, 1.0, 20.0, 3.0]
    assert rows.span(2, 6) is None and rows.span(3, 3) is None  # a gap; an empty span


def test_a_model_needing_other_engine_args_is_refused_by_name():
    class Needs(VllmModelHooks):
        records_rows = True

        def engine_kwargs(self):
            return {"enable_prefix_caching": False, "additional_config": {"x": 1}}

    merged = _with_model_kwargs(3, {"dtype": "float32", "additional_config": {"y": 2}}, Needs())
    assert merged == {
        "dtype": "float32",
        "enable_prefix_caching": False,
        "additional_config": {"y": 2, "x": 1},
        "worker_extension_cls": EXTENSION,
    }
    with pytest.raises(ValueError, match="stage 3: engine_args.enable_prefix_caching is True"):
        _with_model_kwargs(3, {"enable_prefix_caching": True}, Needs())


def test_a_row_recording_model_has_the_prefix_cache_off_unless_its_stage_turns_it_on():
    class Records(VllmModelHooks):
        records_rows = True

    assert _with_model_kwargs(0, {}, Records())["enable_prefix_caching"] is False
    assert _with_model_kwargs(0, {"enable_prefix_caching": True}, Records())["enable_prefix_caching"] is True
    assert "enable_prefix_caching" not in _with_model_kwargs(0, {}, VllmModelHooks())  # vLLM's default


def test_another_vllm_is_refused_with_the_reason():
    check_vllm_version("0.32.0+cpu")
    with pytest.raises(RuntimeError, match="written for vLLM 0.32.0, but vLLM 0.33.1 is installed"):
        check_vllm_version("0.33.1")


def test_a_row_recording_decode_stage_with_the_prefix_cache_on_is_refused_by_name():
    """vLLM's connector pulls part of a prompt around a decode engine's local hits, a path the
    handoff does not check: the YAML key is refused before vLLM starts."""
    from omni_pd import registry
    from omni_pd.config import load_pipeline_config
    from omni_pd.engines.vllm.engine import VllmEngine
    from omni_pd.paths import STAGE_CONFIGS_DIR

    decode = load_pipeline_config(STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_vllm_pd.yaml").stage(1)
    cached = decode.model_copy(
        update={"engine_args": decode.engine_args.model_copy(update={"enable_prefix_caching": True})}
    )
    hooks = registry.vllm_hooks("tiny-qwen3-omni")
    saved = dict(os.environ)  # the engine sets its vLLM environment first
    try:
        with pytest.raises(ValueError, match=r"stage 1: engine_args.enable_prefix_caching is true on"):
            VllmEngine(cached, "tiny-qwen3-omni", hooks)
    finally:
        os.environ.clear()
        os.environ.update(saved)
