"""The same-host GPU KV path: a decode process opens a prefill process's GPU block pool by CUDA
IPC handle and copies the blocks it needs device to device.

This is the only module of the KV plane that needs CUDA. It uses PyTorch's own CUDA IPC (the
storage `_share_cuda_` export and `rebuild_cuda_tensor` import that `torch.multiprocessing`
pickles), written out as plain values so a handle travels in kv_transfer_params like every
other key. Those are private torch interfaces: `supported()` checks the signature this code
was written against and refuses the path, by name, where it differs.

CUDA does not open a handle in the process that exported it: there the handle resolves to the
exported buffer itself (one process holding both sides: the handoff bench).

A handle names a GPU by its UUID, not its index: two processes may number GPUs differently
(CUDA_VISIBLE_DEVICES), and the decode side maps the UUID to its own index, or cannot open the
handle (another host's GPU), in which case the KV moves over Mooncake.
"""

from __future__ import annotations

import base64
import inspect
import json
import os
import weakref
from typing import Any

import torch

# The parameters of torch.multiprocessing.reductions.rebuild_cuda_tensor this code fills in.
_REBUILD_PARAMS = (
    "tensor_cls",
    "tensor_size",
    "tensor_stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "storage_device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
_exported: "weakref.WeakValueDictionary[str, torch.Tensor]" = weakref.WeakValueDictionary()


def supported() -> str | None:
    """None when CUDA IPC can be used here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    from torch.multiprocessing import reductions

    params = tuple(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    if params != _REBUILD_PARAMS:
        return (
            f"torch {torch.__version__}'s rebuild_cuda_tensor takes {params}, not the "
            "parameters omni-pd's CUDA IPC was written for"
        )
    return None


def _b64(data: bytes | None) -> str:
    return base64.b64encode(data).decode() if data else ""


def _unb64(text: str) -> bytes | None:
    return base64.b64decode(text) if text else None


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def export_handle(buffer: torch.Tensor) -> str:
    """A handle to a contiguous uint8 CUDA tensor (a block pool's memory), as a JSON string."""
    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or not buffer.is_contiguous():
        raise ValueError("CUDA IPC exports a contiguous uint8 CUDA tensor")
    why = supported()
    if why:
        raise RuntimeError(f"CUDA IPC is not available: {why}")
    storage = buffer._typed_storage()
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync) = (
        storage._share_cuda_()
    )
    _exported[_b64(handle)] = buffer
    return json.dumps(
        {
            "pid": os.getpid(),
            "uuid": device_uuid(device),
            "handle": _b64(handle),
            "storage_size_bytes": size_bytes,
            "storage_offset_bytes": offset_bytes,
            "ref_counter_handle": _b64(ref_handle),
            "ref_counter_offset": ref_offset,
            "event_handle": _b64(event_handle),
            "event_sync_required": bool(event_sync),
            "tensor_offset": buffer.storage_offset(),
            "nbytes": buffer.numel(),
        }
    )


def _local_index(uuid: str) -> int | None:
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    return None


def open_handle(handle: str) -> torch.Tensor:
    """The peer's buffer as a uint8 CUDA tensor of this process. Raises OSError when it cannot
    be opened here (another host's GPU, or torch's IPC refuses)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    why = supported()
    if why:
        raise OSError(f"CUDA IPC is not available: {why}")
    try:
        h: dict[str, Any] = json.loads(handle)
        if h.get("pid") == os.getpid() and h["handle"] in _exported:
            return _exported[h["handle"]]
        index = _local_index(h["uuid"])
        if index is None:
            raise OSError(f"GPU {h['uuid']} is not visible in this process")
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size([h["nbytes"]]),
            (1,),
            h["tensor_offset"],
            torch.storage.TypedStorage,
            torch.uint8,
            index,
            _unb64(h["handle"]),
            h["storage_size_bytes"],
            h["storage_offset_bytes"],
            False,
            _unb64(h["ref_counter_handle"]),
            h["ref_counter_offset"],
            _unb64(h["event_handle"]),
            h["event_sync_required"],
        )
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - a bad or foreign handle: the caller falls back
        raise OSError(f"cannot open the CUDA IPC handle: {type(exc).__name__}: {exc}") from exc
