"""`omni-pd bench roofline` on each model's tiny checkpoint, quick: every stage's row comes out,
through the model's own runners (Qwen2.5-Omni's speech rows: bench/roofline_qwen2_5.py), with
the speech path's real-time account in each model's frame length. The figures belong to the
real-shape runs (docs/real_shapes.md); this checks that the bench runs."""

from __future__ import annotations

import json

import pytest

from omni_pd.entrypoints.cli import main

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model, frame_ms", [("qwen3_omni", 80.0), ("qwen2_5_omni", 20.0)])
def test_quick_run_measures_every_stage_of_the_model(model, frame_ms, tmp_path, capsys):
    checkpoint = tmp_path / "ckpt"
    assert main(["make-tiny-model", str(checkpoint), "--model", model]) == 0
    out = tmp_path / "roofline.json"
    assert main(["bench", "roofline", str(checkpoint), "--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    stages = {row["stage"].split("[")[0] for row in result["results"]}
    assert stages == {"thinker_prefill", "thinker_decode", "talker_step", "code2wav_chunk"}
    assert all(row["step_ms"] > 0 and row["roofline_ms"] > 0 for row in result["results"])
    by_batch = result["real_time"]["by_batch"]
    assert [b["batch"] for b in by_batch] == [1, 16]
    # rtf is the time a frame of speech takes over the frame's length, the model's own.
    assert by_batch[0]["rtf"] == pytest.approx(by_batch[0]["ms_per_frame"] / frame_ms)
    assert "streams in real time" in capsys.readouterr().out


def test_a_model_without_thinker_rows_is_refused_by_name(tmp_path):
    from omni_pd.models.qwen3_text.tiny_config import ensure_tiny_text_model

    checkpoint = ensure_tiny_text_model(cache_root=tmp_path)
    with pytest.raises(SystemExit, match="no thinker rows for qwen3_text"):
        main(["bench", "roofline", str(checkpoint), "--quick", "--stages", "thinker_decode"])
