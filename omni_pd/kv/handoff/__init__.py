"""The KV handoff: a prefill-side sender that publishes blocks under a lease, a decode-side receiver
that pulls them over Mooncake, and the per-transfer state machine both report through.

Prefill side: PUBLISHED -> DONE (decode side acknowledged) | EXPIRED (lease timed out).
Decode side:  TRANSFERRING -> DONE | FAILED | ABANDONED (the request stopped waiting: miss window
or abort).
Each side keeps its per-transfer objects in one dict, removed when the transfer reaches a final
state, so ``debug_state_counts()`` is all zeros between requests. One exception on the decode
side, counted apart: a transfer that ends while Mooncake may still write its blocks (a frozen
peer resumes late) leaves them in quarantine until Mooncake reports the read finished.

Zero copy on the decode side: when both sides share a block layout, the receiver reads each remote
block straight into a destination block of its pool, which is the decode engine's paged cache
(`KVReceiver(layout, cache.pool, ...)`); the engine hands the request's blocks over for the read
and gets them back, filled and verified, with the result. Only when the layouts differ does a
read land in staging blocks first, converted into the destination blocks in one pass.

Same host: when the prefill's pool is shared memory (`BlockPool(shared=True)`) and the decode
side can map it (`transport.same_host`: same host, same user, the prefill process alive), the receiver
copies each block straight out of the mapping into its destination block and checksums it while
it is hot in cache: one copy, no Mooncake. `same_host` chooses: "auto" (that when possible, else
Mooncake, said once per peer), "shm" (that or the transfer fails), "off" (Mooncake always).

GPU pools: a pool on a GPU is published as it is. On one host the decode side opens it by CUDA
IPC handle (`cuda_ipc`) and copies its blocks device to device, checksummed on the device
("wsum64", see checksum.py): same-host copies cannot corrupt, but the checksum also catches a
block the sender reused after its lease expired, which is why it is kept. Across hosts Mooncake
reads the GPU memory itself where its build registers device memory (a CUDA build); otherwise
each side stages through a pinned host copy of its pool (`kv_buffer_device: cpu`, the only way
with a CPU-only Mooncake): the sender copies the blocks it publishes to the host, the receiver
reads into its host copy and then copies the blocks to its GPU. Which path is in use is logged
once per engine and per peer.

Integrity without a second pass: a read is cut into Mooncake entries of at most
`MAX_ENTRY_BYTES` (adjacent blocks coalesce up to it), and each block's checksum is verified as
soon as the entries covering it have landed, at the poll that sees them, while later entries are
still on the wire; only the last entries' blocks are checked after the read ends.
"""

from __future__ import annotations

from .descriptor import KVDescriptor
from .pools import BUFFER_DEVICE_CHOICES, SAME_HOST_CHOICES
from .receiver import MAX_ENTRY_BYTES, FetchResult, KVReceiver
from .sender import KVSender
from .state import IllegalTransition, Lease, Transfer, TransferState

__all__ = [
    "BUFFER_DEVICE_CHOICES",
    "MAX_ENTRY_BYTES",
    "SAME_HOST_CHOICES",
    "FetchResult",
    "IllegalTransition",
    "KVDescriptor",
    "KVReceiver",
    "KVSender",
    "Lease",
    "Transfer",
    "TransferState",
]
