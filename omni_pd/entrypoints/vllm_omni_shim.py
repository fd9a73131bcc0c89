"""`vllm serve MODEL --omni --stage-configs-path PATH` (or `--deploy-config PATH`, vllm-omni
0.30's deploy schema) reaching omni-pd's server.

vLLM's CLI (0.32) hands every command line holding `--omni` to
`vllm_omni.entrypoints.cli.main:main` when a module named `vllm_omni` can be imported, and exits
with an error otherwise. omni-pd does not claim that name by default: `omni-pd vllm-shim
install` (opt-in) writes a four-file package `vllm_omni` into site-packages whose `main` calls
`omni_pd.entrypoints.cli.run_vllm_command()`, which translates the command line here. It refuses to write where a real vllm-omni is importable (there
`--omni` already has an owner), and `omni-pd vllm-shim uninstall` removes only a package that
carries its marker file.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import shutil
import sysconfig
from pathlib import Path

log = logging.getLogger("omni_pd.vllm_shim")

PACKAGE = "vllm_omni"
MARKER = "OMNI_PD_SHIM"
_HEADER = (
    "# Written by `omni-pd vllm-shim install`: vLLM's CLI hands `--omni` command lines to\n"
    "# this package, which runs omni-pd's server. `omni-pd vllm-shim uninstall` removes it;\n"
    "# do that before installing vllm-omni.\n"
)
SHIM_FILES = {
    "__init__.py": _HEADER + '"""omni-pd\'s stand-in for vllm-omni\'s CLI entry point."""\n',
    "entrypoints/__init__.py": _HEADER,
    "entrypoints/cli/__init__.py": _HEADER,
    "entrypoints/cli/main.py": _HEADER
    + (
        "\n\ndef main() -> None:\n"
        "    from omni_pd.entrypoints.cli import run_vllm_command\n"
        "    run_vllm_command()\n"
    ),
    MARKER: "This vllm_omni package was written by omni-pd; it is not vllm-omni.\n",
}


class ShimError(RuntimeError):
    """The shim cannot be installed / removed, or a `vllm ... --omni` command line is not one
    omni-pd can serve; the message says what to do instead."""


def default_target() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def is_shim(package_dir: Path) -> bool:
    return (package_dir / MARKER).is_file()


def _importable_elsewhere(target: Path) -> Path | None:
    """Where `import vllm_omni` would find a package other than the one under `target`."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = Path(location)
        if found.resolve() != (target / PACKAGE).resolve() and not is_shim(found):
            return found
    return None


def install(target: Path | None = None) -> Path:
    target = Path(target) if target is not None else default_target()
    package_dir = target / PACKAGE
    if package_dir.exists() and not is_shim(package_dir):
        raise ShimError(
            f"{package_dir} holds a vllm_omni package that omni-pd did not write "
            "(vllm-omni itself?): `vllm serve --omni` already goes there, and omni-pd "
            "leaves it alone. Run `omni-pd serve` instead, or uninstall vllm-omni first."
        )
    elsewhere = _importable_elsewhere(target)
    if elsewhere is not None:
        raise ShimError(
            f"vllm-omni is importable from {elsewhere}: `vllm serve --omni` already "
            "goes there, and omni-pd leaves it alone. Run `omni-pd serve` instead, or "
            "uninstall vllm-omni first."
        )
    for relative, text in SHIM_FILES.items():
        path = package_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package_dir


def uninstall(target: Path | None = None) -> Path | None:
    """Remove the shim; None when there was none. Never touches a package omni-pd did not write."""
    package_dir = (Path(target) if target is not None else default_target()) / PACKAGE
    if not package_dir.exists():
        return None
    if not is_shim(package_dir):
        raise ShimError(f"{package_dir} is not omni-pd's shim (no {MARKER} file): left as it is")
    shutil.rmtree(package_dir)
    return package_dir


def status(target: Path | None = None) -> str:
    package_dir = (Path(target) if target is not None else default_target()) / PACKAGE
    if package_dir.exists():
        if not is_shim(package_dir):
            return f"{package_dir}: a package omni-pd did not write"
        if any(
            not (package_dir / name).is_file() or (package_dir / name).read_text() != text
            for name, text in SHIM_FILES.items()
        ):
            return (
                f"{package_dir}: omni-pd's shim, written by another omni-pd version; run "
                "`omni-pd vllm-shim install` again"
            )
        return f"{package_dir}: omni-pd's shim"
    elsewhere = _importable_elsewhere(package_dir.parent)
    if elsewhere is not None:
        return f"not installed; vllm_omni is importable from {elsewhere} (not omni-pd's)"
    return f"not installed (would be written to {package_dir})"


def _vllm_serve_parser() -> argparse.ArgumentParser:
    # The `vllm serve` options that mean the same thing to omni-pd's server; anything else is
    # refused by name rather than silently dropped.
    parser = argparse.ArgumentParser(prog="vllm serve ... --omni", add_help=False)
    parser.add_argument("model_tag", nargs="?", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--stage-configs-path", default=None)
    parser.add_argument("--deploy-config", default=None)
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", default=None)
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument("--uvicorn-log-level", default=None)
    return parser


def translate_vllm_argv(argv: list[str]) -> list[str]:
    """`vllm` arguments (after the program name) -> `omni-pd` arguments."""
    args = [a for a in argv if a != "--omni"]
    if not args or args[0] != "serve":
        raise ShimError(
            f"omni-pd's vllm_omni shim serves `vllm serve MODEL --omni ...` only, not "
            f"`vllm {' '.join(argv)}`; use `omni-pd --help` for the other commands"
        )
    known, unknown = _vllm_serve_parser().parse_known_args(args[1:])
    if unknown:
        raise ShimError(
            f"omni-pd's server does not take {' '.join(unknown)} from `vllm serve`; "
            "engine options belong in the stage YAML's engine_args, and `omni-pd serve "
            "--help` lists the server's own options"
        )
    if known.stage_configs_path and known.deploy_config:
        raise ShimError("give --stage-configs-path or --deploy-config, not both")
    if known.model_tag and known.model and known.model_tag != known.model:
        raise ShimError(f"two models given: {known.model_tag!r} and --model {known.model!r}")
    level = (known.uvicorn_log_level or "info").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ShimError(f"--uvicorn-log-level {known.uvicorn_log_level!r}: use debug, info, warning or error")
    out = ["--log-level", level, "serve"]
    model = known.model_tag or known.model
    if model:
        out.append(model)
    for flag, value in (
        ("--stage-configs-path", known.stage_configs_path),
        ("--deploy-config", known.deploy_config),
        ("--host", known.host),
        ("--port", known.port),
    ):
        if value is not None:
            out += [flag, value]
    if known.served_model_name:
        out += ["--served-model-name", known.served_model_name[0]]
    # Answer as vllm-omni's server answers the clients written for it: speech unless a request
    # names its modalities, and streamed audio in its form (a WAV per chunk in delta.content).
    return out + VLLM_OMNI_ANSWERS


VLLM_OMNI_ANSWERS = ["--default-modalities", "text,audio", "--stream-audio-form", "vllm-omni"]
