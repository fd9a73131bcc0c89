"""Errors raised while loading a stage YAML.

Every problem becomes one `ConfigIssue` naming the file, the stage, the dotted key, the value found
and what would be accepted; `ConfigError` carries all of them so a user fixes a file in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

_MAX_GOT_CHARS = 80


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_GOT_CHARS else text[: _MAX_GOT_CHARS - 3] + "..."


@dataclass(frozen=True)
class ConfigIssue:
    file: str
    stage_id: int | None  # None: a top-level key, or a stage whose id could not be read
    key: str  # dotted path, e.g. "stage_args[1].engine_args.kv_transfer_config.kv_role"
    got: Any  # the offending value (None when the key is missing)
    allowed: str | None  # what would be accepted, or what to change
    message: str

    def __str__(self) -> str:
        if self.stage_id is not None:
            where = f"stage {self.stage_id}"
        else:
            where = "stage ?" if self.key.startswith("stage_args[") else "top level"
        text = f"{self.file}: {where}: {self.key}: {self.message} (got {_short_repr(self.got)})"
        if self.allowed:
            text += f"; allowed: {self.allowed}"
        return text


class ConfigError(ValueError):
    """A stage YAML that cannot be used; `issues` lists every problem found."""

    def __init__(self, issues: Iterable[ConfigIssue]):
        self.issues: tuple[ConfigIssue, ...] = tuple(issues)
        if not self.issues:
            raise ValueError("ConfigError needs at least one issue")
        super().__init__(str(self))

    @property
    def file(self) -> str:
        return self.issues[0].file

    def __str__(self) -> str:
        count = len(self.issues)
        head = f"{count} problem{'s' if count != 1 else ''} in stage config {self.file}:"
        return "\n".join([head, *(f"  - {issue}" for issue in self.issues)])
