"""How a block stores KV bytes, and conversions between the canonical tensor and blocks.

The canonical in-memory form of one request's KV is a tensor
``[num_layers, 2, num_kv_heads, num_tokens, head_dim]`` (2 = K, V): stacking a batch-of-one
transformers ``DynamicCache``'s ``layers[i].keys[0]`` / ``.values[0]`` gives exactly this.

A block holds ``block_size`` tokens. Within a block the axes are ordered as follows
(outermost first):

=========  ============  ==============================
kv_split   order         axes inside one block
=========  ============  ==============================
fused      token_major   token, layer, kv, head, dim
split      token_major   kv, token, layer, head, dim
fused      head_major    layer, head, token, kv, dim
split      head_major    kv, layer, head, token, dim
=========  ============  ==============================

Only fused/token_major keeps the first ``n`` tokens of a block in one contiguous byte range, which
lets a transfer move exactly ``num_tokens * bytes_per_token`` bytes; it is the default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

DTypeName = Literal["float32", "float16", "bfloat16"]
KVSplit = Literal["fused", "split"]
Order = Literal["token_major", "head_major"]

_DTYPES: dict[DTypeName, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_KV_SPLITS = ("fused", "split")
_ORDERS = ("token_major", "head_major")
_INT_FIELDS = ("block_size", "num_layers", "num_kv_heads", "head_dim")

# Axis letters of the 6-d tensor [L, KV, H, NB, B, D] that pack() starts from; each layout lists the
# in-block order (NB, the block index, always comes first).
_CANON_AXES = "LKHNBD"
_BLOCK_AXES: dict[tuple[str, str], str] = {
    ("fused", "token_major"): "BLKHD",
    ("split", "token_major"): "KBLHD",
    ("fused", "head_major"): "LHBKD",
    ("split", "head_major"): "KLHBD",
}


def dtype_name(dtype: torch.dtype) -> DTypeName:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; expected one of {sorted(_DTYPES)}")


@dataclass(frozen=True)
class BlockLayout:
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DTypeName
    kv_split: KVSplit = "fused"
    order: Order = "token_major"

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            # bool is an int subclass; True as a head count is a bug upstream, not a 1.
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_layout.{name}: expected a positive integer, got {value!r}")
        for name, allowed in (("dtype", tuple(_DTYPES)), ("kv_split", _KV_SPLITS), ("order", _ORDERS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"kv_layout.{name}: expected one of {list(allowed)}, got {value!r}")

    @classmethod
    def default_for(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str | torch.dtype, block_size: int = 16
    ) -> "BlockLayout":
        # A name given as text is checked against DTypeName by __post_init__.
        name = cast(DTypeName, dtype) if isinstance(dtype, str) else dtype_name(dtype)
        return cls(
            block_size=block_size,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=name,
            kv_split="fused",
            order="token_major",
        )

    # -- plain-data form for the handshake ---------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "BlockLayout":
        if not isinstance(d, dict):
            raise ValueError(f"kv_layout: expected a dict, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"kv_layout.{unknown[0]}: unknown field; expected only {names}")
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"kv_layout.{missing[0]}: missing")
        return cls(**d)

    # -- sizes -------------------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def token_range_bytes(self, n_tokens_in_block: int) -> int | None:
        """Contiguous byte length holding the first n tokens of a block; None if not contiguous."""
        if not 0 <= n_tokens_in_block <= self.block_size:
            raise ValueError(f"n_tokens_in_block={n_tokens_in_block} outside 0..{self.block_size}")
        if n_tokens_in_block in (0, self.block_size) or (self.kv_split, self.order) == (
            "fused",
            "token_major",
        ):
            return n_tokens_in_block * self.bytes_per_token
        return None

    def transfer_lengths(self, num_tokens: int) -> list[int]:
        """Bytes to move from each block for a num_tokens prompt: only the filled prefix where the
        layout keeps it contiguous, else the whole block (its padding is zeros)."""
        lengths = []
        for index in range(self.num_blocks_for(num_tokens)):
            filled = min(self.block_size, num_tokens - index * self.block_size)
            length = self.token_range_bytes(filled)
            lengths.append(self.block_bytes if length is None else length)
        return lengths

    def same_geometry(self, other: "BlockLayout") -> bool:
        return (self.num_layers, self.num_kv_heads, self.head_dim) == (
            other.num_layers,
            other.num_kv_heads,
            other.head_dim,
        )

    @property
    def _block_axes(self) -> str:
        return _BLOCK_AXES[(self.kv_split, self.order)]


def check_canonical(kv: torch.Tensor, layout: BlockLayout) -> None:
    expected = (layout.num_layers, 2, layout.num_kv_heads, layout.head_dim)
    if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) != expected:
        raise ValueError(
            f"KV tensor of shape {tuple(kv.shape)} does not fit the layout: expected "
            f"[{layout.num_layers}, 2, {layout.num_kv_heads}, num_tokens, {layout.head_dim}]"
        )
    if kv.dtype != layout.torch_dtype:
        raise ValueError(
            f"KV tensor dtype {kv.dtype} differs from the layout's {layout.dtype}; "
            "cast it first or build the layout with the model's dtype"
        )
    if kv.shape[3] < 1:
        raise ValueError("KV tensor holds zero tokens; there is nothing to hand over")


def _canonical_view(blocks: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """A ``[L, 2, H, num_blocks, block_size, D]`` typed view of contiguous uint8 block memory."""
    axes = "N" + layout._block_axes
    sizes = {
        "L": layout.num_layers,
        "K": 2,
        "H": layout.num_kv_heads,
        "N": blocks.shape[0],
        "B": layout.block_size,
        "D": layout.head_dim,
    }
    typed = blocks.view(layout.torch_dtype).reshape([sizes[a] for a in axes])
    return typed.permute([axes.index(a) for a in _CANON_AXES])


def _token_blocks(kv: torch.Tensor, full: int, block_size: int) -> torch.Tensor:
    """The first full*block_size tokens of a canonical tensor as [L, 2, H, full, B, D]."""
    head = kv[:, :, :, : full * block_size]
    return head.reshape(kv.shape[0], 2, kv.shape[2], full, block_size, kv.shape[4])


def pack_blocks(kv: torch.Tensor, layout: BlockLayout, out: torch.Tensor | None = None) -> torch.Tensor:
    """Canonical KV -> ``[num_blocks, block_bytes]`` uint8 (the last block zero-padded).

    ``out``, if given, is contiguous uint8 memory of that shape (e.g. pool blocks) written in place,
    which saves a copy of the whole KV."""
    check_canonical(kv, layout)
    num_tokens = kv.shape[3]
    num_blocks = layout.num_blocks_for(num_tokens)
    shape = (num_blocks, layout.block_bytes)
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, device=kv.device)
    elif out.dtype != torch.uint8 or tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"out must be contiguous uint8 of shape {shape}, got {out.dtype} {tuple(out.shape)}")
    view = _canonical_view(out, layout)
    full, rem = divmod(num_tokens, layout.block_size)
    if full:
        view[:, :, :, :full].copy_(_token_blocks(kv, full, layout.block_size))
    if rem:
        view[:, :, :, full, :rem].copy_(kv[:, :, :, full * layout.block_size :])
        view[:, :, :, full, rem:].zero_()  # padding is zeros so whole-block checksums are stable
    return out


def unpack_blocks(blocks: torch.Tensor, layout: BlockLayout, num_tokens: int) -> torch.Tensor:
    """``[num_blocks, >= block_bytes]`` uint8 -> canonical KV with num_tokens tokens (a new tensor)."""
    num_blocks = layout.num_blocks_for(num_tokens)
    if (
        blocks.dtype != torch.uint8
        or blocks.dim() != 2
        or blocks.shape[0] < num_blocks
        or blocks.shape[1] < layout.block_bytes
        or num_tokens < 1
    ):
        raise ValueError(
            f"expected uint8 blocks of shape [>={num_blocks}, {layout.block_bytes}] for "
            f"{num_tokens} tokens, got {blocks.dtype} {tuple(blocks.shape)}"
        )
    view = _canonical_view(blocks[:num_blocks, : layout.block_bytes].contiguous(), layout)
    kv = torch.empty(
        layout.num_layers,
        2,
        layout.num_kv_heads,
        num_tokens,
        layout.head_dim,
        dtype=layout.torch_dtype,
        device=blocks.device,
    )
    full, rem = divmod(num_tokens, layout.block_size)
    if full:
        _token_blocks(kv, full, layout.block_size).copy_(view[:, :, :, :full])
    if rem:
        kv[:, :, :, full * layout.block_size :].copy_(view[:, :, :, full, :rem])
    return kv


def convert_blocks(
    blocks: torch.Tensor, src_layout: BlockLayout, dst_layout: BlockLayout, num_tokens: int
) -> torch.Tensor:
    """Re-pack blocks written in src_layout into dst_layout (block size, split, order, dtype).

    The one place where a prefill and a decode engine with different layouts meet. Geometry
    (layers, KV heads, head_dim) must match: no conversion can invent heads."""
    check_compatible(src_layout, dst_layout)
    kv = unpack_blocks(blocks, src_layout, num_tokens)
    return pack_blocks(kv.to(dst_layout.torch_dtype), dst_layout)


def check_compatible(src_layout: BlockLayout, dst_layout: BlockLayout) -> None:
    """Raise unless blocks in src_layout can be converted to dst_layout."""
    if not src_layout.same_geometry(dst_layout):
        raise ValueError(
            "KV layouts are incompatible: prefill has "
            f"{src_layout.num_layers} layers x {src_layout.num_kv_heads} kv heads x {src_layout.head_dim} "
            f"head_dim, decode has {dst_layout.num_layers} x {dst_layout.num_kv_heads} x "
            f"{dst_layout.head_dim}; both stages must serve the same model"
        )
