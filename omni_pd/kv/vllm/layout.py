"""vLLM's CPU KV blocks, and their exact translation into omni-pd's fused blocks.

vLLM 0.32's CPU attention (`vllm/v1/attention/backends/cpu_attn.py`, layout `LBHNC`) keeps one
tensor per attention layer, `[num_blocks, num_kv_heads, block_size, 2 * head_size]` in memory
order, which it reads as `[num_blocks, num_kv_heads, 2 * block_size, head_size]`: within a block,
per KV head, the block's K and then its V. With the "vec" kernels (float32 / float16 on x86,
head size a multiple of 32; `_get_attn_isa`) the K half is stored dim-major, `[head_size,
block_size]` (K transposed, for the kernel's dot products), and the V half token-major,
`[block_size, head_size]`; measured against the hf thinker's KV of the same prompt, bit for bit.
Other kernels (amx, vec16, ...) pack K otherwise: refused by name. Its MooncakeConnector
registers one region per layer whose block b starts at `base + b * block_len`.

omni-pd's paged cache stores fused token-major blocks `[block_size, layers, 2 (K, V), kv_heads,
head_dim]` (kv/layout.py). `translate_blocks` moves whole blocks from the first form into the
second and then checks every block byte for byte (the fused block read back in vLLM's order must
equal what arrived), so a wrong mapping can never hand the decode engine shuffled KV.
`translate_blocks_to_vllm` is its reverse, for an hf prefill engine that feeds a vLLM decode
engine (kv/vllm/serve.py), with the same check the other way round; `geometry_of` is the vLLM
geometry an hf engine's blocks translate into.

Geometries that cannot be translated exactly are refused by name (`check_geometry`): another
number of layers (KV slots), block size, KV head count, head dim, dtype, or a CPU attention kernel
whose K packing is not the one translated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..checksum import checksum
from ..errors import KVIncompatibleError, KVIntegrityError
from ..layout import BlockLayout, DTypeName

VLLM_CPU_LAYOUT = "LBHNC"  # vLLM's name for the CPU attention's cache layout
TRANSLATED_ISAS = ("vec",)  # vLLM CPU attention kernels whose K packing translate_blocks knows


@dataclass(frozen=True)
class VllmKVGeometry:
    """What a vLLM producer registered with its MooncakeConnector, and how its blocks are laid out."""

    layer_names: tuple[str, ...]  # vLLM's attention layer names, in registration order
    layer_indices: tuple[int, ...]
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: DTypeName
    attention_isa: str  # vLLM's CPU attention kernel (`layer.isa`): it decides how K is packed
    layout: str = VLLM_CPU_LAYOUT

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def block_bytes(self) -> int:
        """One layer's block: K and V of every head and token."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.num_kv_heads * 2 * self.block_size * self.head_size * itemsize

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer_names": list(self.layer_names),
            "layer_indices": list(self.layer_indices),
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": self.dtype,
            "attention_isa": self.attention_isa,
            "layout": self.layout,
        }

    @classmethod
    def from_dict(cls, data: Any) -> "VllmKVGeometry":
        if not isinstance(data, dict):
            raise ValueError(f"a vLLM KV geometry is a mapping, got {type(data).__name__}")
        return cls(
            layer_names=tuple(str(n) for n in data["layer_names"]),
            layer_indices=tuple(int(i) for i in data["layer_indices"]),
            block_size=int(data["block_size"]),
            num_kv_heads=int(data["num_kv_heads"]),
            head_size=int(data["head_size"]),
            dtype=data["dtype"],
            attention_isa=str(data["attention_isa"]),
            layout=str(data.get("layout", VLLM_CPU_LAYOUT)),
        )


def check_geometry(vllm: VllmKVGeometry, ours: BlockLayout) -> None:
    """Raise KVIncompatibleError naming every field where vLLM's blocks and ours differ."""
    pairs = (
        ("layout", vllm.layout, VLLM_CPU_LAYOUT),
        ("layers (KV slots)", vllm.num_layers, ours.num_layers),
        ("block size", vllm.block_size, ours.block_size),
        ("KV heads", vllm.num_kv_heads, ours.num_kv_heads),
        ("head dim", vllm.head_size, ours.head_dim),
        ("dtype", vllm.dtype, ours.dtype),
    )
    wrong = [
        f"{name}: vLLM {theirs!r}, this engine {mine!r}" for name, theirs, mine in pairs if theirs != mine
    ]
    if vllm.attention_isa not in TRANSLATED_ISAS:
        wrong.append(
            f"CPU attention kernel: vLLM {vllm.attention_isa!r}, translated here "
            f"{', '.join(map(repr, TRANSLATED_ISAS))} (its K packing is another)"
        )
    if len(vllm.layer_indices) != vllm.num_layers:
        wrong.append(f"layer indices: {len(vllm.layer_indices)} for {vllm.num_layers} layer names")
    if wrong:
        raise KVIncompatibleError(
            "the vLLM producer's KV blocks cannot be translated into this engine's exactly ("
            + "; ".join(wrong)
            + "): give both engines the same model, dtype and block size (vLLM's block_size, "
            "the hf stage's kv_block_size)"
        )


def geometry_of(layout: BlockLayout) -> VllmKVGeometry:
    """The vLLM CPU geometry (`vec` kernel) that `layout`'s blocks translate into exactly. Its
    layer names are placeholders (`layers.<i>`): a vLLM consumer's layers are matched by index."""
    return VllmKVGeometry(
        layer_names=tuple(f"layers.{i}" for i in range(layout.num_layers)),
        layer_indices=tuple(range(layout.num_layers)),
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_size=layout.head_dim,
        dtype=layout.dtype,
        attention_isa=TRANSLATED_ISAS[0],
    )


def layer_views(buffer: torch.Tensor, geometry: VllmKVGeometry, num_blocks: int) -> list[torch.Tensor]:
    """`buffer` (bytes: one region per layer of `num_blocks` blocks, back to back) as each layer's
    blocks `[num_blocks, kv_heads, 2 * block_size, head_size]` in vLLM's CPU layout."""
    dtype = getattr(torch, geometry.dtype)
    per_layer = num_blocks * geometry.block_bytes
    if buffer.dtype != torch.uint8 or buffer.numel() < per_layer * geometry.num_layers:
        raise ValueError(
            f"a staging buffer for {geometry.num_layers} layers of {num_blocks} vLLM blocks needs "
            f"{per_layer * geometry.num_layers} bytes, got {buffer.numel()} {buffer.dtype}"
        )
    shape = (num_blocks, geometry.num_kv_heads, 2 * geometry.block_size, geometry.head_size)
    return [
        buffer[i * per_layer : (i + 1) * per_layer].view(dtype).view(shape)
        for i in range(geometry.num_layers)
    ]


def _fused_of(theirs: torch.Tensor, block_size: int) -> torch.Tensor:
    """One block in vLLM's CPU `vec` form (`[layers, heads, 2 * block_size, head_dim]`: per head
    K dim-major, then V token-major) as omni-pd's fused block `[block_size, layers, 2, heads,
    head_dim]`."""
    num_layers, heads, _, head_dim = theirs.shape
    halves = theirs.reshape(num_layers, heads, 2, block_size * head_dim)
    k = halves[:, :, 0].reshape(num_layers, heads, head_dim, block_size).transpose(2, 3)  # dim-major
    v = halves[:, :, 1].reshape(num_layers, heads, block_size, head_dim)
    return torch.stack([k, v], dim=2).permute(3, 0, 2, 1, 4)


def _vllm_of(fused_block: torch.Tensor) -> torch.Tensor:
    """The inverse of `_fused_of`: a fused block `[block_size, layers, 2, heads, head_dim]` in
    vLLM's CPU `vec` form `[layers, heads, 2 * block_size, head_dim]`."""
    block_size, num_layers, _, heads, head_dim = fused_block.shape
    block = fused_block.permute(1, 3, 2, 0, 4)  # [layers, heads, 2, bs, hd]
    return torch.stack(
        [
            block[:, :, 0].transpose(2, 3).reshape(num_layers, heads, -1),  # K, dim-major
            block[:, :, 1].reshape(num_layers, heads, -1),
        ],
        dim=2,
    ).reshape(num_layers, heads, 2 * block_size, head_dim)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def translate_blocks(
    layers: Sequence[torch.Tensor],
    sources: Sequence[int],
    fused: torch.Tensor,
    dests: Sequence[int],
) -> list[str]:
    """Copy vLLM blocks `sources` (of every layer in `layers`, see `layer_views`) into fused blocks
    `dests` of `fused` (`[num_blocks, block_size, layers, 2, kv_heads, head_dim]`), then check each
    block byte for byte; returns each fused block's checksum. Raises KVIntegrityError naming the
    first block whose bytes do not read back."""
    if len(sources) != len(dests):
        raise ValueError(f"{len(sources)} vLLM blocks for {len(dests)} destination blocks")
    block_size = fused.shape[1]
    sums: list[str] = []
    for source, dest in zip(sources, dests):
        theirs = torch.stack([layer[source] for layer in layers])  # [layers, heads, 2 * bs, hd]
        fused[dest] = _fused_of(theirs, block_size)
        # Read back in vLLM's order: K transposed again, V as is, byte for byte.
        if not _same_bytes(_vllm_of(fused[dest]), theirs):
            raise KVIntegrityError(
                f"vLLM block {source} did not translate exactly into block {dest}: its bytes read "
                "back differ (a layout mapping bug; nothing was handed to the decoder)"
            )
        sums.append(checksum(fused[dest]))
    return sums


def translate_blocks_to_vllm(
    fused: torch.Tensor,
    sources: Sequence[int],
    layers: Sequence[torch.Tensor],
    dests: Sequence[int],
) -> None:
    """The reverse of `translate_blocks`: copy fused blocks `sources` of `fused` into vLLM blocks
    `dests` of every layer in `layers` (`layer_views`), then check each block byte for byte (the
    vLLM block read back as a fused block must equal the source). Raises KVIntegrityError naming
    the first block whose bytes do not read back: nothing of it may be sent."""
    if len(sources) != len(dests):
        raise ValueError(f"{len(sources)} fused blocks for {len(dests)} vLLM blocks")
    if len(layers) != fused.shape[2]:
        raise ValueError(f"{len(layers)} vLLM layer views for fused blocks of {fused.shape[2]} layers")
    block_size = fused.shape[1]
    for source, dest in zip(sources, dests):
        theirs = _vllm_of(fused[source])
        for index, layer in enumerate(layers):
            layer[dest] = theirs[index]
        back = _fused_of(torch.stack([layer[dest] for layer in layers]), block_size)
        if not _same_bytes(back, fused[source]):
            raise KVIntegrityError(
                f"fused block {source} did not translate exactly into vLLM block {dest}: its bytes "
                "read back differ (a layout mapping bug; nothing was sent)"
            )
