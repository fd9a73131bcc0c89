import itertools

import pytest
import torch

from omni_pd.kv import BlockLayout, convert_blocks, pack_blocks, unpack_blocks

B = 4
COMBOS = list(itertools.product(("fused", "split"), ("token_major", "head_major")))


def layout(kv_split="fused", order="token_major", block_size=B, dtype="float32", **kw):
    args = dict(num_layers=3, num_kv_heads=2, head_dim=5)
    args.update(kw)
    return BlockLayout(block_size=block_size, dtype=dtype, kv_split=kv_split, order=order, **args)


def canonical(num_tokens, dtype=torch.float32, layers=3, heads=2, head_dim=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, heads, num_tokens, head_dim, generator=g).to(dtype)


def test_bytes_per_token_arithmetic():
    lay = BlockLayout(block_size=16, num_layers=4, num_kv_heads=2, head_dim=16, dtype="bfloat16")
    assert lay.bytes_per_token == 4 * 2 * 2 * 16 * 2 == 512
    assert lay.block_bytes == 16 * 512
    assert BlockLayout.default_for(4, 2, 16, torch.float32).bytes_per_token == 1024
    assert lay.num_blocks_for(16) == 1 and lay.num_blocks_for(17) == 2


@pytest.mark.parametrize("kv_split,order", COMBOS)
@pytest.mark.parametrize("num_tokens", [1, B - 1, B, 3 * B + 5])
def test_pack_unpack_round_trip(kv_split, order, num_tokens):
    lay = layout(kv_split, order)
    kv = canonical(num_tokens)
    blocks = pack_blocks(kv, lay)
    assert blocks.dtype == torch.uint8
    assert blocks.shape == (lay.num_blocks_for(num_tokens), lay.block_bytes)
    assert torch.equal(unpack_blocks(blocks, lay, num_tokens), kv)


def test_layouts_really_differ_in_bytes():
    kv = canonical(2 * B)
    packed = {combo: pack_blocks(kv, layout(*combo)) for combo in COMBOS}
    assert len({bytes(p.numpy()) for p in packed.values()}) == len(COMBOS)


def test_token_major_fused_prefix_is_contiguous_and_padding_zero():
    lay = layout()
    kv = canonical(B + 1)
    blocks = pack_blocks(kv, lay)
    # Token B (the only one in block 1) is its first bytes_per_token bytes, layer-major inside.
    token = kv[:, :, :, B].contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(blocks[1, : lay.bytes_per_token], token)
    assert not blocks[1, lay.bytes_per_token :].any()
    # Packing into reused memory (a pool block) must zero the padding too.
    dirty = torch.full_like(blocks, 0xFF)
    assert torch.equal(pack_blocks(kv, lay, out=dirty), blocks) and not dirty[1, lay.bytes_per_token :].any()
    assert lay.token_range_bytes(3) == 3 * lay.bytes_per_token
    assert lay.transfer_lengths(B + 1) == [lay.block_bytes, lay.bytes_per_token]


@pytest.mark.parametrize("kv_split,order", [c for c in COMBOS if c != ("fused", "token_major")])
def test_other_layouts_have_no_contiguous_prefix(kv_split, order):
    lay = layout(kv_split, order)
    assert lay.token_range_bytes(1) is None
    assert lay.token_range_bytes(B) == lay.block_bytes and lay.token_range_bytes(0) == 0
    assert lay.transfer_lengths(B + 1) == [lay.block_bytes, lay.block_bytes]


@pytest.mark.parametrize("num_tokens", [1, 7, 3 * B + 5])
def test_convert_between_layouts_and_block_sizes(num_tokens):
    src, dst = layout("fused", "token_major", block_size=B), layout("split", "head_major", block_size=3)
    kv = canonical(num_tokens)
    converted = convert_blocks(pack_blocks(kv, src), src, dst, num_tokens)
    assert converted.shape == (dst.num_blocks_for(num_tokens), dst.block_bytes)
    assert torch.equal(unpack_blocks(converted, dst, num_tokens), kv)


def test_convert_float32_to_bfloat16_matches_torch_cast():
    src, dst = layout(), layout("split", "token_major", block_size=8, dtype="bfloat16")
    kv = canonical(11)
    out = unpack_blocks(convert_blocks(pack_blocks(kv, src), src, dst, 11), dst, 11)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, kv.to(torch.bfloat16))


def test_convert_rejects_different_geometry():
    with pytest.raises(ValueError, match="kv heads"):
        convert_blocks(pack_blocks(canonical(3), layout()), layout(), layout(num_kv_heads=4), 3)


def test_pack_rejects_wrong_shape_and_dtype():
    with pytest.raises(ValueError, match="does not fit the layout"):
        pack_blocks(canonical(3, heads=4), layout())
    with pytest.raises(ValueError, match="dtype"):
        pack_blocks(canonical(3, dtype=torch.float16), layout())


def test_dict_round_trip():
    lay = layout("split", "head_major", dtype="float16")
    assert BlockLayout.from_dict(lay.to_dict()) == lay


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_size", 0),
        ("num_layers", "4"),
        ("num_kv_heads", True),
        ("head_dim", -1),
        ("dtype", "int8"),
        ("kv_split", "interleaved"),
        ("order", "layer_major"),
    ],
)
def test_from_dict_names_the_bad_field(field, value):
    d = layout().to_dict()
    d[field] = value
    with pytest.raises(ValueError, match=rf"kv_layout\.{field}"):
        BlockLayout.from_dict(d)


def test_from_dict_missing_and_unknown_fields():
    d = layout().to_dict()
    del d["head_dim"]
    with pytest.raises(ValueError, match=r"kv_layout\.head_dim: missing"):
        BlockLayout.from_dict(d)
    with pytest.raises(ValueError, match=r"kv_layout\.page_size: unknown"):
        BlockLayout.from_dict({**layout().to_dict(), "page_size": 4})
