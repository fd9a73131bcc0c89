"""Turn pydantic validation errors into `ConfigIssue`s that say what to change.

Unknown keys get a "did you mean" suggestion computed from the keys allowed at that exact place,
found by walking the schema types along the error's location.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Iterable

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from omni_pd.config.errors import ConfigIssue

Loc = tuple[int | str, ...]
_UNKNOWN_KEY_TYPES = {"extra_forbidden", "unexpected_keyword_argument"}
_MAX_LISTED_KEYS = 25


def format_key(loc: Iterable[int | str]) -> str:
    """("stage_args", 1, "engine_args") -> "stage_args[1].engine_args"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def suggest(name: str, allowed: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(name, sorted(allowed), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _unwrap(tp: Any) -> list[Any]:
    """The concrete types behind Optional / Union / Annotated."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(tp) for t in _unwrap(arg)]
    return [tp]


def _keys_of(tp: Any) -> dict[str, Any] | None:
    """{key name as written in YAML: annotation} for a model or dataclass type, else None."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return {(f.alias or name): f.annotation for name, f in tp.model_fields.items()}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(tp)}
    return None


def allowed_keys_at(root: type, loc: Loc) -> set[str] | None:
    """Keys accepted by the mapping at `loc` below `root` (None if it is not a typed mapping)."""
    candidates: list[Any] = [root]
    for part in loc:
        nxt: list[Any] = []
        for tp in (t for c in candidates for t in _unwrap(c)):
            origin, args = typing.get_origin(tp), typing.get_args(tp)
            if isinstance(part, int) and origin in (list, tuple) and args:
                nxt.append(args[0])
            elif origin is dict and len(args) == 2:
                nxt.append(args[1])
            elif isinstance(part, str) and (keys := _keys_of(tp)) and part in keys:
                nxt.append(keys[part])
        candidates = nxt
    found: set[str] = set()
    typed = False
    for tp in (t for c in candidates for t in _unwrap(c)):
        keys = _keys_of(tp)
        if keys is not None:
            typed = True
            found.update(keys)
    return found if typed else None


def _describe_allowed(allowed: set[str]) -> str:
    if len(allowed) <= _MAX_LISTED_KEYS:
        return ", ".join(sorted(allowed))
    return f"one of {len(allowed)} known keys (omni-pd, vllm-omni and vLLM EngineArgs names)"


def _issue_from_error(
    err: ErrorDetails, root: type, file: str, stage_id: int | None, prefix: Loc
) -> ConfigIssue:
    loc: Loc = tuple(err["loc"])
    key = format_key(prefix + loc)
    kind = err["type"]
    if kind in _UNKNOWN_KEY_TYPES and loc:
        name = str(loc[-1])
        allowed = allowed_keys_at(root, loc[:-1]) or set()
        hint = suggest(name, allowed)
        message = f"unknown key '{name}'" + (f"; did you mean '{hint}'?" if hint else "")
        return ConfigIssue(file, stage_id, key, err.get("input"), _describe_allowed(allowed), message)
    if kind == "missing":
        return ConfigIssue(file, stage_id, key, None, "add this key", "required key is missing")
    message = str(err["msg"]).removeprefix("Value error, ")
    got = err.get("input")
    if kind == "value_error":
        # A constructor check such as SamplingParams' "max_tokens must be ..." names its key
        # first; point the issue at that key rather than at the enclosing mapping.
        first_word = message.split(" ", 1)[0]
        if first_word in (allowed_keys_at(root, loc) or set()):
            key = format_key(prefix + loc + (first_word,))
            if isinstance(got, dict):
                got = got.get(first_word)
    expected: str | None = None
    ctx = err.get("ctx") or {}
    if "expected" in ctx:
        expected = str(ctx["expected"])
    return ConfigIssue(file, stage_id, key, got, expected, message)


def issues_from_validation_error(
    exc: ValidationError, root: type, file: str, stage_id: int | None = None, prefix: Loc = ()
) -> list[ConfigIssue]:
    """One issue per pydantic error; `prefix` is where `root` sits in the file."""
    return [_issue_from_error(err, root, file, stage_id, prefix) for err in exc.errors(include_url=False)]
