"""Mixed-kernel P/D (issue 36): a prefill worker and a decode worker started under different
`ATEN_CPU_CAPABILITY` (through the stage's `runtime.env`) compute with different kernels. The
first handoff names the pair in one WARNING; `require_identical_kernels: true` refuses it, and
the decode engine serves the request by prefilling it itself."""

from __future__ import annotations

import pytest
import torch
import yaml

from omni_pd.orchestrator.omni import Omni
from omni_pd.paths import STAGE_CONFIGS_DIR

pytestmark = pytest.mark.slow
PREFILL, DECODE = 0, 1
HOST = torch.backends.cpu.get_cpu_capability().lower()
# A level below this host's, which it can run: the prefill worker computes as an older CPU.
OTHER = {"avx512": "avx2", "avx2": "default"}.get(HOST)
PROMPTS = ["Hi", "Tell me about the sea."]


def _thinker_pd(tmp_path, name: str, prefill_env: dict[str, str], strict: bool | None = None) -> str:
    """The tiny P/D config cut to its thinker pair (text out of the decode stage)."""
    config = yaml.safe_load((STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml").read_text())
    config["stage_args"] = config["stage_args"][:2]
    config["runtime"]["edges"] = config["runtime"]["edges"][:1]
    config["async_chunk"] = False
    config["stage_args"][PREFILL]["runtime"]["env"] = prefill_env
    if strict is not None:
        extra = config["stage_args"][DECODE]["engine_args"]["kv_transfer_config"]["kv_connector_extra_config"]
        extra["require_identical_kernels"] = strict
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if " WARNING " in line and "different kernels" in line]


def _run(path: str) -> tuple[list, dict]:
    with Omni(stage_configs_path=path, request_timeout_s=60) as omni:
        outputs = [omni.generate(p)[0] for p in PROMPTS]
        counts = omni.debug_state_counts()
    return outputs, counts


@pytest.mark.skipif(OTHER is None, reason=f"no lower CPU level to emulate below {HOST}")
def test_mixed_kernels_warn_once_and_strict_pairs_refuse(tmp_path, capfd, caplog):
    # The same kernels on both sides (the prefill's variable set to this host's own level):
    # no warning, the negative control for what follows.
    outputs, counts = _run(_thinker_pd(tmp_path, "same.yaml", {"ATEN_CPU_CAPABILITY": HOST}))
    same_err = capfd.readouterr().err
    assert not _warnings(same_err), _warnings(same_err)
    assert all(not o.metrics.get("kv_fallback") for o in outputs)
    reference = [o.token_ids for o in outputs]

    # The prefill worker computes as an older CPU: one WARNING for two handoffs, naming both levels.
    outputs, counts = _run(_thinker_pd(tmp_path, "mixed.yaml", {"ATEN_CPU_CAPABILITY": OTHER}))
    err = capfd.readouterr().err
    warned = _warnings(err)
    assert len(warned) == 1, warned
    assert f"cpu_capability: prefill '{OTHER}', decode '{HOST}'" in warned[0]
    assert all(not o.metrics.get("kv_fallback") for o in outputs)  # accepted: the KV was used
    assert all(v == 0 for v in counts.values()), counts

    # Strict: the first handoff is refused naming the pair, and the decode engine prefills the
    # prompt itself, so the answer is the one the same-kernel pair gave.
    outputs, counts = _run(_thinker_pd(tmp_path, "strict.yaml", {"ATEN_CPU_CAPABILITY": OTHER}, strict=True))
    assert outputs[0].metrics.get("kv_fallback")
    refused = [
        r.getMessage() for r in caplog.records if "require_identical_kernels is true" in r.getMessage()
    ]
    assert len(refused) == 1 and "KVIncompatibleError" in refused[0], refused
    assert f"cpu_capability: prefill '{OTHER}', decode '{HOST}'" in refused[0]
    assert [o.token_ids for o in outputs][:1] == reference[:1]
    assert all(v == 0 for v in counts.values()), counts


def test_an_unknown_capability_fails_the_stage_by_name(tmp_path):
    path = _thinker_pd(tmp_path, "bogus.yaml", {"ATEN_CPU_CAPABILITY": "avx9000"})
    with pytest.raises(
        Exception,
        match=r"stage 0.*ATEN_CPU_CAPABILITY='avx9000' is not a CPU "
        r"capability torch knows.*use one of default",
    ):
        Omni(stage_configs_path=path, request_timeout_s=60)
