"""Block checksums, computed where the block lies.

"xxh3": xxh3-64 of the bytes, for blocks in host memory (a few GB/s on one core).
"wsum64": two sums modulo 2**64 over the bytes' 64-bit words, computed by torch on whatever
device holds the block (a GPU block is checksummed on the GPU, with no copy to the host). The
first weighs each word by its own odd constant: any change to one word changes it (an odd
weight is invertible modulo 2**64). The second mixes each weighted word with itself (a
xor-shift, then times its own shifted bits): not linear, so changes to several words do not
cancel there as they can in the first (two flipped top bits do). Integer sums do not depend on
the reduction order, so the GPU and the CPU agree bit for bit: a receiver verifies on its own
device. Like xxh3 here, it guards against memory that changed (a reused block, a broken copy),
not an adversary.

A descriptor names the kind its sender used; a pool's kind follows its device.
"""

from __future__ import annotations

from typing import Sequence

import torch
import xxhash

CHECKSUM_KINDS = ("xxh3", "wsum64")
_weights: dict[torch.device, torch.Tensor] = {}


def kind_for(device: torch.device | str) -> str:
    return "xxh3" if torch.device(device).type == "cpu" else "wsum64"


def _splitmix64(count: int) -> torch.Tensor:
    """`count` odd int64 constants from splitmix64 (the same on every machine)."""
    mask = (1 << 64) - 1
    state, out = 0x9E3779B97F4A7C15, []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z = (z ^ (z >> 31)) | 1
        out.append(z - (1 << 64) if z >= 1 << 63 else z)
    return torch.tensor(out, dtype=torch.int64, device="cpu")


def _weights_for(words: int, device: torch.device) -> torch.Tensor:
    have = _weights.get(device)
    if have is None or have.numel() < words:
        size = 1 << max(words - 1, 255).bit_length()  # grow by powers of two
        base = _splitmix64(4096)
        # Beyond 4096 words the constants repeat with a position-dependent odd offset, which
        # keeps every weight odd and distinct modulo 2**64.
        # On the host, beside `base`: a stage worker on a GPU makes that GPU torch's default device.
        index = torch.arange(size, dtype=torch.int64, device="cpu")
        have = (base[index % 4096] + 2 * (index // 4096)).to(device)
        _weights[device] = have
    return have[:words]


def _wsum64_words(words: torch.Tensor, nbytes: int) -> list[str]:
    """wsum64 of each row of `words` ([rows, n] int64, each row a block's bytes, zero-padded to
    whole words), every row `nbytes` long. All rows in one pass and one copy to the host: a GPU
    pool's per-block checksums were one device sync each (~0.25 ms a block on an H100). Integer
    sums modulo 2**64 do not depend on their order, so a row's value is the one `wsum64` gives."""
    weighted = words * _weights_for(words.shape[1], words.device)  # wraps modulo 2**64
    mixed = weighted ^ ((weighted >> 31) & 0x1FFFFFFFF)  # a logical shift (masked)
    mixed = mixed * (((mixed >> 17) & 0x7FFFFFFFFFFF) | 1)
    linear, nonlinear = torch.stack([weighted.sum(dim=1), mixed.sum(dim=1)]).tolist()
    mask = (1 << 64) - 1
    seed = nbytes * 0x9E3779B97F4A7C15  # the length counts
    return [f"{(a + seed) & mask:016x}{b & mask:016x}" for a, b in zip(linear, nonlinear)]


def wsum64(data: torch.Tensor) -> str:
    flat = data.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    n = flat.numel()
    tail = n % 8
    if tail or flat.data_ptr() % 8:
        padded = torch.zeros(n + (8 - tail) % 8, dtype=torch.uint8, device=flat.device)
        padded[:n] = flat
        flat = padded
    return _wsum64_words(flat.view(torch.int64).view(1, -1), n)[0]


def checksums(views: Sequence[torch.Tensor], kind: str = "xxh3") -> list[str]:
    """`checksum` of each uint8 view. wsum64 takes views of the same length together, in one pass
    (a handoff's full blocks; a shorter last block goes alone)."""
    if kind != "wsum64":
        return [checksum(view, kind) for view in views]
    out: list[str | None] = [None] * len(views)
    groups: dict[tuple[int, torch.device], list[int]] = {}
    for i, view in enumerate(views):
        groups.setdefault((view.numel(), view.device), []).append(i)
    for (nbytes, _), members in groups.items():
        if nbytes % 8 or len(members) == 1:
            for i in members:
                out[i] = wsum64(views[i])
            continue
        rows = torch.stack([views[i].reshape(-1) for i in members])  # a fresh, aligned copy
        for i, value in zip(members, _wsum64_words(rows.view(torch.int64), nbytes)):
            out[i] = value
    return [value for value in out if value is not None]


def checksum(data: torch.Tensor, kind: str = "xxh3") -> str:
    """The checksum of a block's bytes (a uint8 tensor)."""
    if kind == "xxh3":
        return xxhash.xxh3_64_hexdigest(
            # numpy's stubs give ndarray its __buffer__ only for Python >= 3.12; it is a buffer here too.
            data.numpy() if data.device.type == "cpu" else data.cpu().numpy()  # type: ignore[arg-type]
        )
    if kind == "wsum64":
        return wsum64(data)
    raise ValueError(f"checksum kind must be one of {list(CHECKSUM_KINDS)}, got {kind!r}")
