"""Errors in OpenAI's shape: the error JSON, the framework's errors (validation, unknown URL or
method, unreadable body) in OpenAI's words, and the orchestrator's exceptions as API errors (and
the outcome each is counted as)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...orchestrator.async_omni import PromptTooLong, RequestAborted, RequestTimeout
from ...orchestrator.stage_client import StageError, StageTimeout, StageUnavailable
from .protocol import CHAT_PATH, APIError
from .server_state import ServerState

log = logging.getLogger(__name__)


class _ErrorJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        # ASCII: an error quoting a client's invalid text (a lone surrogate) still encodes.
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return _ErrorJSONResponse(error.body.model_dump(), status_code=error.status, headers=headers)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param_path(loc: tuple) -> str | None:
    """pydantic's ("body", "messages", 0, "content") -> "messages[0].content", as translate names
    fields."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or "[" in part:  # which member of a union failed, not a field
            continue
        else:
            out += f".{part}" if out else part
    return out or None


def _count_bad_request(state: ServerState, request: Request) -> None:
    if request.url.path == CHAT_PATH:
        state.metrics.requests.labels(outcome="bad_request").inc()


def _validation_error_message(request: Request, exc: RequestValidationError) -> APIError:
    """pydantic's first complaint about a body, as one 400 naming the field."""
    first = exc.errors()[0] if exc.errors() else {}
    loc, kind = tuple(first.get("loc", ())), first.get("type")
    if kind == "json_invalid":
        at = f" at character {loc[1]}" if len(loc) > 1 else ""
        return APIError(
            400,
            f"the request body is not valid JSON: {(first.get('ctx') or {}).get('error', '')}{at}",
            code="invalid_json",
        )
    where = _param_path(loc)
    if where is None and kind == "missing":
        message = "the request body is missing: send a JSON object with `model` and `messages`"
    elif where is None:
        content_type = request.headers.get("content-type", "application/json")
        message = "the request body must be a JSON object with `model` and `messages`" + (
            ""
            if "json" in content_type
            else f", sent with Content-Type: application/json, not {content_type!r}"
        )
    else:
        message = f"{where}: {first.get('msg', 'invalid')}"
    return APIError(400, message, param=where)


def _http_error_message(state: ServerState, request: Request, exc: StarletteHTTPException) -> APIError:
    """Starlette's own errors (unknown URL or method, an unreadable body) in OpenAI's words."""
    message = str(exc.detail)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    elif exc.status_code == 400 and exc.__cause__ is not None:  # the body could not be read
        _count_bad_request(state, request)
        message = (
            f"the request body could not be read as JSON ({type(exc.__cause__).__name__}: "
            f"{exc.__cause__}); send a UTF-8 JSON object"
        )
    kind = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
    return APIError(exc.status_code, message, type=kind)


def add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Every error, ours or the framework's, leaves in OpenAI's error JSON."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        _count_bad_request(state, request)
        return error_response(_validation_error_message(request, exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(_http_error_message(state, request, exc), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):  # Starlette logs it, then re-raises
        return error_response(APIError(500, f"{type(exc).__name__}: {exc}", type="internal_server_error"))


def as_api_error(state: ServerState, exc: BaseException) -> BaseException:
    if isinstance(exc, APIError):
        state.metrics.requests.labels(outcome="bad_request").inc()
        return exc
    if isinstance(exc, PromptTooLong):
        state.metrics.requests.labels(outcome="bad_request").inc()
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, ValueError):
        state.metrics.requests.labels(outcome="bad_request").inc()
        return APIError(400, str(exc), param="messages")
    if isinstance(exc, (RequestTimeout, StageTimeout)):  # the request's deadline passed
        state.metrics.requests.labels(outcome="timeout").inc()
        return APIError(504, str(exc), type="timeout")
    if isinstance(exc, StageUnavailable):  # restarting or down: nothing was computed
        state.metrics.requests.labels(outcome="unavailable").inc()
        retry = exc.retry_after_s
        return APIError(
            503,
            str(exc),
            type="service_unavailable",
            headers={"retry-after": str(max(1, round(retry)))} if retry else None,
        )
    if isinstance(exc, (RequestAborted, asyncio.CancelledError)):
        state.metrics.requests.labels(outcome="aborted").inc()
        return exc
    state.metrics.requests.labels(outcome="error").inc()
    if isinstance(exc, StageError):
        return APIError(500, str(exc), type="internal_server_error")
    log.exception("request failed", exc_info=exc)
    return APIError(500, f"{type(exc).__name__}: {exc}", type="internal_server_error")
