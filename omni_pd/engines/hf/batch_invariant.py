"""Batch-invariant building blocks for the hf engines' batched forward passes.

A request's greedy output must not depend on what else is in its batch. On CPU, a row of
`F.linear` computed in a matrix of 1-5 rows takes other kernels (gemv, small-M paths) than the same
row in a matrix of 8 or more rows, and differs in the last bits; with random-weight logits nearly
flat, that flips tokens. So every linear layer here runs on tiles of exactly `ROW_TILE` rows (the
last tile padded with zeros): a row's result then comes from the same kernel, the same shape and
the same reduction order whatever the batch holds (tests/test_batch_invariant.py checks row
position and neighbours). MoE experts run on the same tiles, each expert in use on its routed
rows (native kernel or tiles; or, for tiny experts, every expert on every row: `experts_form`), and each row sums its
experts' contributions in ascending expert order, as transformers does, so a row's sum does not
depend on which other rows picked which experts. Per-row ops (RMSNorm, rotary, softmax/top-k over
one row) are invariant already; elementwise activations are made so (`activation`, `sigmoid`: see
there); attention is computed per sequence: `attend_rows` for prompts (tiled too, so a row does
not depend on how much of its prompt is computed in the call either), `attend`, or the engines'
native decode kernel.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from . import experts_native

ROW_TILE = 16
_enabled = True


def set_enabled(enabled: bool) -> None:
    """Switch the tiles off (or back on) for this process: a test hook (the hf engines' control
    call `set_batch_invariant`) for end-to-end negative controls; on by default."""
    global _enabled
    _enabled = bool(enabled)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Plain `F.linear` on the whole batch inside this block: the negative control the tests use
    to show that without the tiles a batched request stops matching its solo run."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def _tiled_rows(count: int) -> int:
    """Rows once `count` is padded with zero rows to whole tiles (at least one)."""
    return max(ROW_TILE, -(-count // ROW_TILE) * ROW_TILE)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed on fixed tiles of `ROW_TILE` rows."""
    if not _enabled:
        return F.linear(x, weight, bias)
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    count = rows.shape[0]
    padded = _tiled_rows(count)
    if padded != count:
        rows = F.pad(rows, (0, 0, 0, padded - count))  # zero rows
    if padded == ROW_TILE:  # one tile (every decode step of up to 16 requests): no concatenation
        out = F.linear(rows, weight, bias)
    else:
        out = torch.cat([F.linear(rows[i : i + ROW_TILE], weight, bias) for i in range(0, padded, ROW_TILE)])
    return out[:count].reshape(*shape[:-1], weight.shape[0])


def linear_module(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias)


# At least this many rows go into a row-wise norm. CUDA's reduction kernels choose their launch
# shape from the number of rows: with few rows, more threads share each row's sum, which then adds
# in another order, and a row's last bits move with the batch. From 16 rows on (32 with 1,024-
# thread blocks) the shape, and with it each row's order, is fixed; 64 leaves a margin. The CPU's
# norms are row-count invariant already (tests/test_batch_invariant.py); the padding costs them
# microseconds, and the same code runs on both.
NORM_MIN_ROWS = 64


def norm(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A row-wise norm over the last dimension (transformers' RMSNorm, a q/k norm) with a row's
    bits independent of how many rows share the call: fewer than `NORM_MIN_ROWS` rows are padded
    with zero rows (which a norm maps to zeros; each row is normalised alone)."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    count = rows.shape[0]
    if count >= NORM_MIN_ROWS or not _enabled:
        return module(x)
    return module(F.pad(rows, (0, 0, 0, NORM_MIN_ROWS - count)))[:count].reshape(shape)


# -- elementwise activations ------------------------------------------------------------------
#
# torch's CPU kernels for sigmoid and SiLU compute a contiguous tensor in vectors of 2 x the ISA's
# width (32 floats with AVX-512, 16 with AVX2) and the elements past the last whole vector (and
# past each thread's chunk) with a scalar formula whose last bit differs for some inputs. An
# element's result then depends on its distance from the tensor's end: on how many rows the
# batch holds. Which rows land in the tail depends on the ISA, so a batch that is exact on one
# host is not on another (issue 36: the talker on AVX-512). exp, the basic arithmetic ops and
# sqrt compute every element with the same code (exp through a vector map that also takes the
# tail as a partial vector; the others correctly rounded in both forms), so the forms below,
# built from them, give an element the same bits wherever it sits. tests/test_batch_invariant.py
# checks both claims on the host it runs on.


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`torch.sigmoid`, to within rounding, the same bits at any position of any tensor."""
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """`F.silu`, to within rounding, the same bits at any position of any tensor."""
    return x / (1.0 + torch.exp(-x))


# transformers' activation modules (by class name) that have a position-invariant form here.
_ACTIVATIONS = {"SiLUActivation": silu, "SiLU": silu, "Sigmoid": sigmoid}


def activation(act_fn) -> Callable[[torch.Tensor], torch.Tensor]:
    """The position-invariant form of a model's activation module (`mlp.act_fn`). One without
    such a form is refused by name: running it as it is would make a request's bits depend on
    its batch."""
    name = type(act_fn).__name__
    form = _ACTIVATIONS.get(name)
    if form is None:
        raise NotImplementedError(
            f"the batch-invariant hf engines have no exact form of the activation {name} (they "
            f"have {', '.join(sorted(_ACTIVATIONS))}): add one to "
            "omni_pd/engines/hf/batch_invariant.py, or serve this model with engine: vllm"
        )
    return form


def check_activations(model: torch.nn.Module) -> None:
    """Refuse, at start, a model whose activations have no position-invariant form here."""
    for module in model.modules():
        act_fn = getattr(module, "act_fn", None)
        if isinstance(act_fn, torch.nn.Module):
            activation(act_fn)


def dense_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    """transformers' gated MLP (gate_proj, up_proj, down_proj, act_fn)."""
    act = activation(mlp.act_fn)
    return linear_module(mlp.down_proj, act(linear_module(mlp.gate_proj, x)) * linear_module(mlp.up_proj, x))


def route(router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' top-k router: (weights [rows, k], expert indices [rows, k])."""
    logits = linear(x, router.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top_value, top_index = torch.topk(probs, router.top_k, dim=-1)
    if router.norm_topk_prob:
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return top_value.to(logits.dtype), top_index


# An MoE layer's three exact forms, chosen by the shape of its experts and the stage's kernels
# (`experts_form`).
#  * native: each expert that some row picked runs on its rows only, in the C kernel of
#    native/experts.c (experts_native.py), every output element one dot product computed alone.
#    A step reads the weights of the experts in use, which is what an MoE costs: at the real
#    thinker's shape (128 experts, top-8, 2048 x 768) one row's step reads 8 of 128 experts, and
#    runs within 1.05x of the plain routed product (docs/real_shapes.md).
#  * tiles: the same on torch ops (the stage's `attention_kernels: torch`, bf16, or a GPU): each
#    expert in use on its rows padded to fixed 16-row tiles; exact, but an expert with one row
#    computes 16 (2-2.5x the plain routed product at the real shape).
#  * every expert: every expert on every row, as one tiled product for all experts' gate/up
#    projections and one batched product per tile for their down projections, 0 for the experts
#    a row did not pick. A fixed dozen ops a step: where the experts are tiny, the per-op
#    overhead of the routed forms costs more than the work.
# Either way a row adds its experts' outputs in ascending expert order, weighted by its routing
# weight, so its bits do not depend on which experts other rows picked. The rule was measured
# (docs/real_shapes.md): on this CPU the every-expert form is as fast or faster while all
# experts' weights of one layer fit in EVERY_EXPERT_MAX_BYTES (the tiny model's 4 x 16 x 64
# floats: 0.09 MiB), the routed forms from a few MiB up (the medium model's 96 MiB: 0.7 against
# 38 ms a row). The form depends on the shapes, the dtype and the kernels setting alone, so a
# prefill engine and its decode engine agree on it whenever their compute identities agree.
EVERY_EXPERT_MAX_BYTES = 2 * 2**20


def experts_form(module, kernels: str = "torch") -> str:
    """'every', 'native' or 'tiles' for an experts module on a stage with `kernels` (see above)."""
    weights = module.gate_up_proj.numel() + module.down_proj.numel()
    if weights * module.gate_up_proj.element_size() <= EVERY_EXPERT_MAX_BYTES:
        return "every"
    if kernels == "native" and experts_native.supports(module) and activation(module.act_fn) is silu:
        return "native"
    return "tiles"


def experts(
    module, x: torch.Tensor, top_index: torch.Tensor, top_weights: torch.Tensor, kernels: str = "torch"
) -> torch.Tensor:
    """transformers' fused experts (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) on rows `x`
    routed to `top_index` with `top_weights` ([rows, k] each), batch-invariant in the layer's
    form; untiled (the negative control): only the routed rows, per expert, plain products."""
    form = experts_form(module, kernels) if _enabled else "tiles"
    if form == "every":
        return _every_expert(module, x, top_index, top_weights)
    rows, weights, counts = routed_pairs(top_index, top_weights, module.gate_up_proj.shape[0])
    if form == "native":
        return experts_native.routed_experts(module, x, rows, weights, counts).to(x.dtype)
    return _routed_experts(module, x, rows, weights, counts)


def routed_pairs(
    top_index: torch.Tensor, top_weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's (row, slot) routing pairs grouped by expert, ascending (a stable sort keeps rows
    ascending in a group): each pair's row, its routing weight, and the pairs per expert."""
    k = top_index.shape[1]
    flat = top_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order // k, top_weights.reshape(-1)[order], torch.bincount(flat, minlength=num_experts)


def _every_expert(
    module, x: torch.Tensor, top_index: torch.Tensor, top_weights: torch.Tensor
) -> torch.Tensor:
    count, width = x.shape
    num_experts, double, _ = module.gate_up_proj.shape
    inter = double // 2
    gate_up = linear(x, module.gate_up_proj.reshape(num_experts * double, width))
    gate_up = gate_up.view(count, num_experts, double)
    hidden = activation(module.act_fn)(gate_up[..., :inter]) * gate_up[..., inter:]  # [rows, E, I]
    padded = _tiled_rows(count)
    hidden = F.pad(hidden.transpose(0, 1), (0, 0, 0, padded - count))  # [E, tiles of rows, I]
    down = module.down_proj.transpose(1, 2)  # [E, I, H]
    outputs = torch.cat(
        [torch.bmm(hidden[:, i : i + ROW_TILE], down) for i in range(0, padded, ROW_TILE)], dim=1
    )[:, :count]  # [E, rows, H]
    weights = torch.zeros((count, num_experts), dtype=top_weights.dtype).scatter(1, top_index, top_weights)
    out = torch.zeros_like(x)
    for expert in range(num_experts):
        out = out + outputs[expert] * weights[:, expert : expert + 1]
    return out


def _routed_experts(
    module, x: torch.Tensor, pair_rows: torch.Tensor, pair_weights: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """The experts in use, ascending, each on its rows (`routed_pairs`): on fixed tiles through
    `linear` when the tiles are on, plain products when they are off (the negative control)."""
    out = torch.zeros_like(x)
    act = activation(module.act_fn)
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if not n:
            continue
        rows, weights = pair_rows[start : start + n], pair_weights[start : start + n]
        start += n
        gate, up = linear(x[rows], module.gate_up_proj[expert]).chunk(2, dim=-1)
        hidden = linear(act(gate) * up, module.down_proj[expert])
        out.index_add_(0, rows, hidden * weights[:, None])
    return out


def sparse_moe(block, x: torch.Tensor, kernels: str = "torch") -> torch.Tensor:
    """An MoE block in transformers' layout (`gate`, `experts`, optional `shared_expert` and
    `shared_expert_gate`) on [rows, hidden]: routed experts, plus the gated shared expert when
    the block has one."""
    weights, index = route(block.gate, x)
    out = experts(block.experts, x, index, weights, kernels)
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        out = out + sigmoid(linear_module(block.shared_expert_gate, x)) * dense_mlp(shared, x)
    return out


def mlp(block, x: torch.Tensor, kernels: str = "torch") -> torch.Tensor:
    """A decoder layer's feed-forward part, sparse or dense; `kernels` is the stage's setting
    (`native` lets large MoE layers run on the experts kernel)."""
    if hasattr(block, "experts"):
        return sparse_moe(block, x, kernels)
    return dense_mlp(block, x)


# -- attention, one sequence per call ---------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding, half-split (the GPT-NeoX form transformers uses), with the
    same operations in the same order as transformers, so the bits match its attention.
    q, k: [batch, heads, rows, head_dim]; cos, sin: [batch, rows, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def projections(
    attn, x: torch.Tensor, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (q_norm, rotary), k (k_norm, rotary), v of rows `x` ([rows, hidden]), each
    [1, heads, rows, head_dim], as transformers' attention computes them. An attention without
    q/k norms has its projections rotated as they are."""
    rows = x.shape[0]

    def heads(module: torch.nn.Linear) -> torch.Tensor:
        return linear_module(module, x).view(rows, -1, head_dim)

    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    q, k = heads(attn.q_proj), heads(attn.k_proj)
    q = (q if q_norm is None else norm(q_norm, q)).transpose(0, 1).unsqueeze(0)
    k = (k if k_norm is None else norm(k_norm, k)).transpose(0, 1).unsqueeze(0)
    v = heads(attn.v_proj).transpose(0, 1).unsqueeze(0)
    q, k = rotary(q, k, cos, sin)
    return q, k, v


def decoder_layer(
    layer, h: torch.Tensor, cos, sin, index: int, attention, head_dim: int, kernels: str
) -> torch.Tensor:
    """One pre-norm decoder layer, as transformers' layers compute it, over a step's rows `h`
    ([rows, hidden]): norm, q/k/v with rotary, the step's `attention(index, q, k, v, scale)`
    (the engine's, which knows each row's sequence and cache), the output projection, then the
    norm and MLP, each with its residual."""
    attn = layer.self_attn
    q, k, v = projections(attn, norm(layer.input_layernorm, h), head_dim, cos, sin)
    out = attention(index, *(t[0].transpose(0, 1) for t in (q, k, v)), attn.scaling)
    h = h + linear_module(attn.o_proj, out)
    return h + mlp(layer.mlp, norm(layer.post_attention_layernorm, h), kernels)


KEY_CHUNK = 64  # keys per step of the prompt attention's running softmax
TILE_GROUP = 8  # query tiles per product: every product of a prompt's attention has this batch


def attend_rows(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, start: int
) -> torch.Tensor:
    """Causal attention of one sequence's rows at positions `start .. start + m` (q
    [1, heads, m, hd]) over all its keys/values so far ([1, kv_heads, start + m, hd]); returns
    [m, heads * hd].

    A row's bits depend on its query and the keys up to its own position, and on nothing else:
    not on how many rows share the call, where they start, or how many keys follow. The prefix
    cache depends on it: a prompt prefilled over cached blocks computes its rows exactly as the
    whole prompt's prefill does, and the cached rows were computed by another, shorter or longer,
    prompt. torch's fused attention moves a row's last bits with all three.

    How: the queries run on fixed tiles of `ROW_TILE` rows, `TILE_GROUP` tiles to a product (the
    last group padded with zero tiles), so every product has the same shape and the same batch
    count whatever the call: cuBLAS picks its kernel, and with it the order of a dot product's
    sums, from the batch count too (the first GPU run saw a prompt over cached blocks, one tile,
    differ from the whole prompt's 69). The keys are taken `KEY_CHUNK` at a time, in order from
    position 0, with a running (online) softmax per row. A group entirely before a chunk's keys
    is skipped; for a row, a chunk after it is masked out entirely and changes nothing (a factor
    of exactly 1, a sum plus exact zeros), so the rows of one group need not agree on where they
    stop."""
    heads, count, hd = q.shape[1], q.shape[2], q.shape[3]
    kv_heads, total = keys.shape[1], keys.shape[2]
    if total != start + count:
        raise ValueError(f"attend_rows: {total} keys for rows {start}..{start + count}")
    k = keys[0].repeat_interleave(heads // kv_heads, dim=0)  # [heads, n, hd]
    v = values[0].repeat_interleave(heads // kv_heads, dim=0)
    tiles = -(-count // ROW_TILE)
    room = tiles + TILE_GROUP - 1  # a group that starts at the last tile still has its tiles
    rows = F.pad(q[0], (0, 0, 0, room * ROW_TILE - count)).view(heads, room, ROW_TILE, hd)
    chunks = -(-total // KEY_CHUNK)
    padded = chunks * KEY_CHUNK - total
    k_t = F.pad(k, (0, 0, 0, padded)).transpose(1, 2).contiguous()  # [heads, hd, chunks * C]
    v = F.pad(v, (0, 0, 0, padded))
    row_position = (start + torch.arange(room * ROW_TILE)).view(room, ROW_TILE, 1)
    acc = torch.zeros((heads, room, ROW_TILE, hd), dtype=q.dtype)
    top = torch.full((heads, room, ROW_TILE, 1), float("-inf"), dtype=q.dtype)
    total_weight = torch.zeros((heads, room, ROW_TILE, 1), dtype=q.dtype)
    for chunk in range(chunks):
        first_key = chunk * KEY_CHUNK
        keys_here = slice(first_key, first_key + KEY_CHUNK)
        key_position = first_key + torch.arange(KEY_CHUNK)
        # The first tile whose last row reaches this chunk: earlier tiles are done with keys.
        t0 = max(0, -(-(first_key - start - ROW_TILE + 1) // ROW_TILE))
        for g in range(t0, tiles, TILE_GROUP):
            group = slice(g, g + TILE_GROUP)
            scores = torch.matmul(rows[:, group], k_t[:, None, :, keys_here]) * scale
            scores = scores.masked_fill(
                (key_position > row_position[group]) | (key_position >= total), float("-inf")
            )
            old = top[:, group]
            new = torch.maximum(old, scores.amax(dim=-1, keepdim=True))
            factor = torch.exp(old - new)
            weights = torch.exp(scores - new)
            acc[:, group] = acc[:, group] * factor + torch.matmul(weights, v[:, None, keys_here])
            total_weight[:, group] = total_weight[:, group] * factor + weights.sum(dim=-1, keepdim=True)
            top[:, group] = new
    out = (acc[:, :tiles] / total_weight[:, :tiles]).reshape(heads, tiles * ROW_TILE, hd)[:, :count]
    return out.transpose(0, 1).reshape(count, -1)


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, cached: int
) -> torch.Tensor:
    """One sequence's attention: q [1, heads, n, hd] for its last n positions over keys/values
    [1, kv_heads, cached + n, hd]; returns [n, heads * hd]."""
    count = q.shape[2]
    if count > 1 and cached:
        raise NotImplementedError("multi-row attention after cached positions (chunked prefill)")
    out = F.scaled_dot_product_attention(
        q.contiguous(), keys, values, is_causal=count > 1, scale=scale, enable_gqa=keys.shape[1] != q.shape[1]
    )
    return out[0].transpose(0, 1).reshape(count, -1)
