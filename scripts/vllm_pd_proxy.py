"""vLLM's own P/D behind a minimal proxy, the peer row of scripts/vllm_bench_compare.sh (issue 48,
item 7): what vLLM's disaggregated-serving examples do (their toy proxy), for two `vllm serve`
processes with the MooncakeConnector (`kv_producer`, `kv_consumer`).

Each chat completion goes to the prefill server first with `max_tokens` 1, no stream and
`kv_transfer_params` {do_remote_decode: true, transfer_id}; the prefill's answer carries the
`kv_transfer_params` that point at its KV (on vLLM 0.32 only with omni-pd's `prefill_kv_params`
fix, which omni-pd's vLLM plugin applies in every vLLM process); then the request goes to the
decode server with those params, and its answer (streamed or not) is passed to the client as it
comes. The first token therefore comes from the decode server, after the handoff, as in vLLM's
examples.

    .venv/bin/python scripts/vllm_pd_proxy.py --prefill http://127.0.0.1:8312 \\
        --decode http://127.0.0.1:8313 --port 8311
"""

from __future__ import annotations

import argparse
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def build_app(prefill: str, decode: str) -> FastAPI:
    app = FastAPI(title="vLLM P/D proxy")
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=256))

    @app.get("/health")
    async def health() -> Response:
        for base in (prefill, decode):
            if (await client.get(f"{base}/health")).status_code != 200:
                return Response(status_code=503)
        return Response(status_code=200)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        transfer_id = f"xfer-{uuid.uuid4().hex}"
        first = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "transfer_id": transfer_id,
            },
        }
        first.pop("stream_options", None)
        first.pop("max_completion_tokens", None)
        answer = await client.post(f"{prefill}/v1/chat/completions", json=first)
        if answer.status_code != 200:
            return JSONResponse(answer.json(), status_code=answer.status_code)
        params = answer.json().get("kv_transfer_params")
        if not params:
            return JSONResponse(
                {
                    "error": {
                        "message": "the prefill server returned no kv_transfer_params (is omni-pd's "
                        "prefill_kv_params fix applied there?)"
                    }
                },
                status_code=502,
            )
        second = {**body, "kv_transfer_params": params}
        if not body.get("stream"):
            answer = await client.post(f"{decode}/v1/chat/completions", json=second)
            return JSONResponse(answer.json(), status_code=answer.status_code)

        async def relay():
            async with client.stream("POST", f"{decode}/v1/chat/completions", json=second) as streamed:
                async for piece in streamed.aiter_raw():
                    yield piece

        return StreamingResponse(relay(), media_type="text/event-stream")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="the kv_producer server's base URL")
    parser.add_argument("--decode", required=True, help="the kv_consumer server's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8311)
    args = parser.parse_args()
    uvicorn.run(build_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
