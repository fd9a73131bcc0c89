"""Websocket subprotocols of the Realtime API, as browsers use them.

A browser cannot set headers on a websocket handshake, so OpenAI's Realtime API takes what a
browser client would send as headers in the subprotocol list instead:
`new WebSocket(url, ["realtime", "openai-insecure-api-key.<key>", "openai-beta.realtime-v1"])`.
The key entry is a bearer credential like `Authorization: Bearer <key>` ("insecure": the key
sits in a page's script and in the handshake's headers, where proxies may log it). The server
must answer with one of the offered subprotocols or the browser drops the socket; it answers
`realtime` (never the key entry)."""

from __future__ import annotations

from typing import Any

REALTIME = "realtime"
API_KEY_PREFIX = "openai-insecure-api-key."
BETA = "openai-beta.realtime-v1"  # the subprotocol form of `OpenAI-Beta: realtime=v1`


def offered(scope: dict[str, Any]) -> list[str]:
    """The subprotocols the client offered (ASGI splits the Sec-WebSocket-Protocol header)."""
    return list(scope.get("subprotocols") or ())


def offered_api_key(scope: dict[str, Any]) -> str | None:
    """The key in an `openai-insecure-api-key.<key>` entry, or None when there is none."""
    for protocol in offered(scope):
        if protocol.startswith(API_KEY_PREFIX):
            return protocol[len(API_KEY_PREFIX) :]
    return None


def chosen(scope: dict[str, Any]) -> str | None:
    """The subprotocol the server answers with: `realtime` where offered, else none."""
    return REALTIME if REALTIME in offered(scope) else None


def wants_beta(scope: dict[str, Any]) -> bool:
    return BETA in offered(scope)
