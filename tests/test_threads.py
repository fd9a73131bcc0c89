"""Each stage worker runs torch with the threads its stage config (or the default share of the
cores) gives it."""

from pathlib import Path

from omni_pd.config import load_pipeline_config
from omni_pd.orchestrator.omni import Omni
from omni_pd.orchestrator.threads import stage_threads
from omni_pd.paths import STAGE_CONFIGS_DIR

TINY = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"
TINY_PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml"


def test_default_is_an_equal_share_of_the_cores_never_zero():
    stages = load_pipeline_config(TINY_PD).stages  # four worker processes
    assert set(stage_threads(stages, cores=2).values()) == {(1, 1)}
    assert set(stage_threads(stages, cores=16).values()) == {(4, 1)}
    assert set(stage_threads(load_pipeline_config(TINY).stages, cores=8).values()) == {(2, 1)}


def _with_threads(tmp_path: Path) -> Path:
    text = TINY.read_text().replace(
        "      max_batch_size: 64   # requests one engine step may hold (max_num_seqs)\n",
        "      max_batch_size: 64\n      num_threads: 2\n      num_interop_threads: 3\n",
        1,
    )
    path = tmp_path / "threads.yaml"
    path.write_text(text)
    return path


def test_the_yaml_setting_reaches_the_worker(tmp_path):
    path = _with_threads(tmp_path)
    assert stage_threads(load_pipeline_config(path).stages, cores=2)[0] == (2, 3)
    with Omni(stage_configs_path=path) as omni:
        threads = ("num_threads", "num_interop_threads")
        assert [omni.control(0, "runtime_info")[k] for k in threads] == [2, 3]
        # The other stages keep the default share: 2 cores over 3 workers is one thread each.
        assert [omni.control(1, "runtime_info")[k] for k in threads] == [1, 1]


def test_bad_thread_counts_are_refused_by_name(tmp_path):
    import pytest
    from omni_pd.config import ConfigError

    path = tmp_path / "bad.yaml"
    path.write_text(
        TINY.read_text().replace(
            "      max_batch_size: 64   # requests one engine step may hold (max_num_seqs)\n",
            "      num_threads: 0\n",
            1,
        )
    )
    with pytest.raises(ConfigError, match=r"runtime\.num_threads"):
        load_pipeline_config(path)


def test_the_orchestrator_runs_torch_on_one_thread_while_the_workers_compute():
    """Every stage in a worker process: the orchestrator's process uses one torch thread for as
    long as the pipeline is open (its small ops would otherwise wait on cores the workers hold),
    and gets its setting back at close."""
    import torch
    from omni_pd.orchestrator.threads import orchestrator_threads

    assert orchestrator_threads(load_pipeline_config(TINY_PD).stages) == 1
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with Omni(stage_configs_path=TINY):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_an_in_process_stage_keeps_the_orchestrators_threads(tmp_path):
    from omni_pd.orchestrator.threads import orchestrator_threads

    path = tmp_path / "inproc.yaml"
    path.write_text(TINY.read_text().replace("      process: true\n", "      process: false\n", 1))
    assert orchestrator_threads(load_pipeline_config(path).stages) is None
