"""The KV data plane: block layouts, a registered block pool, the KV transport (its interface,
with Mooncake and the same-host paths behind it), the prefill -> decode handoff (pull and push)
and vLLM interop (kv/vllm/). It knows bytes, blocks and peers, not prompts or models."""

from .errors import (
    KVError,
    KVIncompatibleError,
    KVIntegrityError,
    KVMissError,
    KVTransferError,
    PoolExhausted,
)
from .handoff import (
    FetchResult,
    IllegalTransition,
    KVDescriptor,
    KVReceiver,
    KVSender,
    Lease,
    Transfer,
    TransferState,
)
from .layout import BlockLayout, convert_blocks, dtype_name, pack_blocks, unpack_blocks
from .pool import BlockPool
from .transport import AsyncRead, KVTransport, MooncakeTransport, ReadState, TransferHandle, open_transport

__all__ = [
    "AsyncRead",
    "BlockLayout",
    "BlockPool",
    "FetchResult",
    "IllegalTransition",
    "KVDescriptor",
    "KVError",
    "KVIncompatibleError",
    "KVIntegrityError",
    "KVMissError",
    "KVReceiver",
    "KVSender",
    "KVTransport",
    "KVTransferError",
    "Lease",
    "MooncakeTransport",
    "PoolExhausted",
    "ReadState",
    "Transfer",
    "TransferHandle",
    "TransferState",
    "convert_blocks",
    "dtype_name",
    "pack_blocks",
    "open_transport",
    "unpack_blocks",
]
