"""Read a YAML file whose top level must be a mapping; any failure is one `ConfigError`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from omni_pd.config.errors import ConfigError, ConfigIssue


def read_yaml_mapping(path: Path, file: str) -> dict[str, Any]:
    def fail(got: Any, allowed: str, message: str) -> ConfigError:
        return ConfigError([ConfigIssue(file, None, "<file>", got, allowed, message)])

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise fail(str(path), "path to an existing stage YAML", "file not found") from None
    except OSError as exc:
        raise fail(str(path), "a readable file", f"cannot read file: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise fail(None, "valid YAML", f"not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise fail(
            type(data).__name__,
            "a mapping with a top-level 'stage_args' list (or 'stages': a deploy file)",
            "the file's top level is not a mapping",
        )
    return data
