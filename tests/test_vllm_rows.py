"""The generic pieces of the vLLM row recording, without a vLLM engine: how a pass's rows are
split by request, how a request's rows are kept by position, and the version guard."""

from __future__ import annotations

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


def test_another_vllm_is_refused_with_the_reason():
    check_vllm_version("0.32.0+cpu")
    with pytest.raises(RuntimeError, match="written for vLLM 0.32.0, but vLLM 0.33.1 is installed"):
        check_vllm_version("0.33.1")
