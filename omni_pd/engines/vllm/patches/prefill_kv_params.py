"""Fix (a): the prefill request's output carries the keys a router needs to send the decode request.

Upstream (vLLM 0.32.0, `MooncakeConnectorScheduler.request_finished`): on the producer side it
returns `(delay_free_blocks, None)`, so a prefill request's `RequestOutput.kv_transfer_params` is
None. Whoever routes the decode request must learn the prefill engine's engine id and bootstrap
address out of band, and cannot tell whether the KV was kept for sending at all (only a
`FINISHED_LENGTH_CAPPED` prefill keeps it; an EOS / stop-token finish frees it at once).

Patched: for a request with `do_remote_decode` and a `transfer_id`, the returned params are
  do_remote_prefill=True, do_remote_decode=False      (ready to forward, as NixlConnector does)
  remote_engine_id       this engine's kv_transfer_config.engine_id
  remote_bootstrap_addr  "http://<host>:<bootstrap port>" of this engine's bootstrap server
  remote_request_id      the prefill request's id inside vLLM
  transfer_id            the shared key, unchanged
  omni_pd_kv_published   True when the blocks are held for the decode side, False when they were
                         freed (the request did not end length-capped)
  omni_pd_finish_status  the vLLM request status at finish
The blocks are held or freed exactly as upstream decides.
"""

from __future__ import annotations

import inspect

from ._guard import Patch, mark_patched

SUPPORTED = ("0.32.0",)


def _bootstrap_addr(vllm_config) -> str:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        get_mooncake_bootstrap_addr,
    )
    from vllm.utils.network_utils import get_ip

    host, port = get_mooncake_bootstrap_addr(vllm_config)
    explicit = vllm_config.kv_transfer_config.get_from_extra_config("bootstrap_server_address", None)
    if explicit is None and host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", ""):
        # The server listens on all interfaces; give peers this host's address (VLLM_HOST_IP).
        host = get_ip()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _install() -> str | None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    cls = mc.MooncakeConnectorScheduler
    source = inspect.getsource(cls.request_finished)
    if "return delay_free_blocks, None" not in source:
        return "MooncakeConnectorScheduler.request_finished no longer returns None params"
    original = cls.request_finished

    def request_finished(self, request, block_ids):
        delay_free_blocks, params = original(self, request, block_ids)
        req_params = request.kv_transfer_params
        if (
            params is not None
            or not req_params
            or not req_params.get("do_remote_decode")
            or not req_params.get("transfer_id")
            or self.is_kv_consumer
        ):
            return delay_free_blocks, params
        kv_config = self.vllm_config.kv_transfer_config
        out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": kv_config.engine_id,
            "remote_bootstrap_addr": _bootstrap_addr(self.vllm_config),
            "remote_request_id": request.request_id,
            "transfer_id": req_params["transfer_id"],
            "omni_pd_kv_published": bool(delay_free_blocks),
            "omni_pd_finish_status": getattr(request.status, "name", str(request.status)),
        }
        return delay_free_blocks, out

    mark_patched(cls, "request_finished", request_finished)
    return None


PATCH = Patch(
    name="prefill_kv_params",
    what="MooncakeConnector prefill outputs carry remote_engine_id / remote_bootstrap_addr / "
    "remote_request_id / transfer_id in kv_transfer_params",
    supported=SUPPORTED,
    install=_install,
)
