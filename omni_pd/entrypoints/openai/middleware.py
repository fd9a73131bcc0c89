"""ASGI middleware in front of the app: the API key on /v1 (HTTP and websockets) and the request
body limit, both enforced before the app reads a byte of the body."""

from __future__ import annotations

import json
import secrets
import time

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response
from .hop_trace import SCOPE_KEY
from .protocol import APIError
from .realtime import subprotocols

# Websocket close codes (RFC 6455): a policy the client broke (its key, its model), and a server
# that cannot serve yet.
WS_POLICY_VIOLATION, WS_TRY_AGAIN_LATER = 1008, 1013


class _BodyTooLarge(Exception):
    pass


class RequestGuard:
    """ASGI middleware that refuses, before the app reads a byte of the body: /v1/* requests
    without `Authorization: Bearer <api_key>` (401; /health and /metrics stay open, as in vLLM),
    and bodies over `max_request_bytes` (413), by their Content-Length or, without one, by
    counting the body as it streams in."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_request_bytes: int | None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key)

    def _too_large(self) -> JSONResponse:
        limit = self.max_request_bytes
        return error_response(
            APIError(
                413,
                f"the request body is over this server's limit of {limit} bytes "
                f"({limit / 2**20:g} MiB); send less (a shorter audio clip, or FLAC / OGG instead of "
                "WAV), or start the server with a larger --max-request-bytes",
                code="request_too_large",
            )
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # The request's arrival, before its body is read: the server's TTFT counts from here.
        scope.setdefault("state", {})[SCOPE_KEY] = time.perf_counter()
        headers = Headers(scope=scope)
        if (
            self.api_key
            and scope["path"].startswith("/v1")
            and scope["method"] != "OPTIONS"
            and not self._authorized(headers)
        ):
            response = error_response(
                APIError(
                    401,
                    "missing or incorrect API key: send the header `Authorization: Bearer <key>` "
                    "with the key the server was started with (--api-key or OMNI_PD_API_KEY)",
                    code="invalid_api_key",
                ),
                headers={"www-authenticate": "Bearer"},
            )
            return await response(scope, receive, send)
        limit = self.max_request_bytes
        if not limit:
            return await self.app(scope, receive, send)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            return await self._too_large()(scope, receive, send)
        received, refused, started = 0, False, False

        async def counted_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    refused = True
                    if not started:
                        await self._too_large()(scope, receive, send)
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 is the answer; the app's own (to the error it got) is dropped
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not refused:
                raise

    def _subprotocol_authorized(self, scope: Scope) -> bool:
        key = subprotocols.offered_api_key(scope)
        return key is not None and secrets.compare_digest(key.encode(), self.api_key)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The same key rule for /v1 websockets (the Realtime API), checked at the handshake; the
        key comes as the header or, from browsers, as the subprotocol
        `openai-insecure-api-key.<key>` (realtime/subprotocols.py). A client that offered
        subprotocols (a browser, which cannot read a refused handshake's status) is refused in
        the protocol: the socket opens, one `error` event (code `invalid_api_key`), then a close
        with 1008. Other clients get a 401 where the server can answer a handshake with HTTP
        (uvicorn can), else the 1008 close."""
        if (
            not self.api_key
            or not scope["path"].startswith("/v1")
            or self._authorized(Headers(scope=scope))
            or self._subprotocol_authorized(scope)
        ):
            return await self.app(scope, receive, send)
        await receive()  # websocket.connect
        if subprotocols.offered(scope):
            await send({"type": "websocket.accept", "subprotocol": subprotocols.chosen(scope)})
            await send(
                {
                    "type": "websocket.send",
                    "text": json.dumps(
                        {
                            "type": "error",
                            "event_id": "event_refused",
                            "error": {
                                "type": "invalid_request_error",
                                "code": "invalid_api_key",
                                "param": None,
                                "event_id": None,
                                "message": "missing or incorrect API key: offer the "
                                "subprotocol `openai-insecure-api-key.<key>` (or send the header "
                                "`Authorization: Bearer <key>`) with the key the server was started with",
                            },
                        }
                    ),
                }
            )
            await send(
                {
                    "type": "websocket.close",
                    "code": WS_POLICY_VIOLATION,
                    "reason": "missing or incorrect API key",
                }
            )
        elif "websocket.http.response" in scope.get("extensions", {}):
            body = json.dumps(
                APIError(
                    401,
                    "missing or incorrect API key: send the header "
                    "`Authorization: Bearer <key>` (browsers: the subprotocol "
                    "`openai-insecure-api-key.<key>`) with the key the server "
                    "was started with (--api-key or OMNI_PD_API_KEY)",
                    code="invalid_api_key",
                ).body.model_dump()
            ).encode()
            await send(
                {
                    "type": "websocket.http.response.start",
                    "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
                }
            )
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send(
                {
                    "type": "websocket.close",
                    "code": WS_POLICY_VIOLATION,
                    "reason": "missing or incorrect API key",
                }
            )
