"""code2wav computed so that a sample's value does not depend on how many frames were decoded.

Streaming speech decodes codec frames in chunks, and the chunks must add up to the waveform of the
whole utterance bit for bit. Qwen3-Omni's code2wav is causal (sliding-window attention,
left-padded convolutions), so a chunk's samples depend on the same inputs as in the whole decode;
but on CPU the stock kernels do not compute them the same way: `F.linear` and `conv1d` pick
kernels and blockings by the length of the input, and rotary embeddings start at position 0 for
every call. This module runs the same weights with every length-dependent op replaced:

- the pre-transformer's and upsampler's linear layers are matrix products over time-major rows
  (`tiled_linear`), the decoder's convolutions products over channel-major columns, time being
  the long side (`column_product`; a convolution adds its taps' products into one output in tap
  order); never fewer than `MIN_ROWS` time steps nor a single output, so a time step's result
  comes from the same kernel and reduction order whatever the length or its position. For the
  few channels of the last decoder layers this is also faster than oneDNN's convolution;
- attention is computed per query over exactly its window of `sliding_window` keys, with the
  rotary angle of the frame's position in the utterance;
- everything else is per element or per time step already.

A streamed utterance carries every layer's state from chunk to chunk (`Code2WavStream`: the
pre-transformer's keys and values, each convolution's input tail), so each sample is computed
once; or, with a left context, the decoder re-runs its receptive field (10 frames for the
shipped configs) before each chunk, vllm-omni's way.

The result differs from transformers' forward in the last bits only (a test bounds it), and the
chunks add up to the whole decode exactly (tests/test_code2wav_stream.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from omni_pd.engines.hf import batch_invariant as bi
from omni_pd.engines.hf.native_build import check_choice

log = logging.getLogger(__name__)
MIN_ROWS = 16


def tiled_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(rows, weight, bias)` for rows [N, K], computed so that a row's result does not
    depend on N or on the row's position. Measured on CPU (tests/test_code2wav_stream.py guards
    it for the model's shapes): one matrix product of at least `MIN_ROWS` rows with at least two
    outputs gives every row the same bits; fewer rows (gemv and small-M kernels) or a single
    output column (a dot-product kernel) do not. So short inputs are padded with zero rows and a
    one-output weight with a zero output."""
    count = rows.shape[0]
    outputs = weight.shape[0]
    if count < MIN_ROWS:
        rows = torch.cat([rows, rows.new_zeros((MIN_ROWS - count, rows.shape[1]))])
    if outputs == 1:
        weight = torch.cat([weight, weight.new_zeros(weight.shape)])
        bias = None if bias is None else torch.cat([bias, bias.new_zeros(1)])
    out = F.linear(rows, weight, bias)
    return out[:count, :outputs]


def column_product(weight: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """`weight @ columns` for weight [M, K] and columns [K, N] (channel-major time steps),
    computed so that a column's result does not depend on N or on its position: as with
    `tiled_linear`, at least `MIN_ROWS` columns and two output rows (measured on this CPU;
    tests/test_code2wav_stream.py guards the model's shapes)."""
    count = columns.shape[1]
    rows = weight.shape[0]
    if count < MIN_ROWS:
        columns = torch.cat([columns, columns.new_zeros((columns.shape[0], MIN_ROWS - count))], dim=1)
    if rows == 1:
        weight = torch.cat([weight, weight.new_zeros(weight.shape)])
    return torch.mm(weight, columns)[:rows, :count]


@dataclass(frozen=True)
class Code2WavGeometry:
    """How frames map to samples, derived from the code2wav config.

    A decode of T frames yields `T * samples_per_frame - trim` samples (the decoder's transposed
    convolutions drop `trim` samples at the end). Sample j depends on frames up to
    floor((j + trim) / samples_per_frame), and back from there `attention_frames` through the
    pre-transformer plus `decoder_frames` through the convolutional decoder."""

    samples_per_frame: int
    trim: int
    attention_frames: int  # the pre-transformer's reach back: layers * (sliding_window - 1)
    decoder_frames: int  # the convolutional decoder's reach back, rounded up

    @property
    def receptive_field_frames(self) -> int:
        return self.attention_frames + self.decoder_frames

    def samples(self, frames: int) -> int:
        return max(frames * self.samples_per_frame - self.trim, 0)


def geometry(config) -> Code2WavGeometry:
    """Derive the geometry from a `Qwen3OmniMoeCode2WavConfig`, layer by layer.

    Reach back, in frames: every attention layer sees `sliding_window - 1` earlier frames; a
    causal convolution with kernel k and dilation d sees (k - 1) * d earlier samples of its own
    rate; a decoder block's transposed convolution (kernel 2s, stride s) mixes each output with
    one earlier input sample. Each reach is divided by its rate in samples per frame and the sum
    rounded up: an upper bound, which is what a left context must cover."""
    rates = list(config.upsampling_ratios) + list(config.upsample_rates)
    samples_per_frame = math.prod(rates)
    reach = 0.0
    rate = 1
    for factor in config.upsampling_ratios:  # transposed conv (no overlap), then ConvNeXt k=7
        rate *= factor
        reach += 6 / rate
    reach += 6 / rate  # the decoder's first causal conv, k=7
    trim = 0
    for index, factor in enumerate(config.upsample_rates):
        reach += 1 / rate  # the transposed conv's overlap with the previous input sample
        rate *= factor
        reach += sum(6 * d for d in (1, 3, 9)) / rate  # residual units, k=7, dilations 1, 3, 9
        trim += factor * math.prod(config.upsample_rates[index + 1 :])
    reach += 6 / rate  # the final causal conv, k=7
    return Code2WavGeometry(
        samples_per_frame,
        trim,
        attention_frames=config.num_hidden_layers * (config.sliding_window - 1),
        decoder_frames=math.ceil(reach - 1e-9),
    )


@dataclass
class Code2WavStream:
    """One streamed utterance's carried state: the pre-transformer's keys and values for the
    last `sliding_window - 1` frames (per layer), and either every decoder convolution's last
    inputs (`carry`: nothing is computed twice) or, with a left context, the pre-transformer's
    outputs for the frames the decoder re-runs (`hidden_tail`)."""

    frames: int = 0  # frames decoded so far
    # torch kernels: per layer (keys, values); native: one [layers, 2, window - 1, width] buffer
    past: list[tuple[torch.Tensor, torch.Tensor]] | torch.Tensor | None = None
    carry: dict = field(default_factory=dict)  # decoder module -> its input tail
    hidden_tail: torch.Tensor | None = None  # [<= left context, hidden]


class ExactCode2Wav:
    """code2wav with length-invariant kernels: whole utterances, or chunks of a stream.

    `kernels`: "native" runs the embedding, pre-transformer, upsampler and convolutional decoder
    on omni-pd's C loops (code2wav_native.py, about 3x faster per streamed utterance), "torch"
    on the torch ops below. Either way chunks add up to the whole decode exactly; the two differ
    in the last bits."""

    def __init__(self, module: torch.nn.Module, kernels: str = "native"):
        check_choice(kernels, "code2wav_kernels")
        bi.check_activations(module.pre_transformer)
        self.m = module
        self.config = module.config
        self.geometry = geometry(self.config)
        self.window = self.config.sliding_window
        self.kernels = kernels
        self._snake_factors: dict = {}  # SnakeBeta module -> (exp(alpha), 1 / (exp(beta) + eps))
        self._native = self._front = self._upsampler = None
        if kernels == "native":
            from .code2wav_native import NativeDecoder, NativeTransformer, NativeUpsampler

            self._native = NativeDecoder(module)
            # The embedding, pre-transformer and upsampler cost a few torch ops per layer, fixed
            # per chunk (~0.4 ms of a streamed chunk's ~2.5): one C loop each instead.
            if (why := NativeTransformer.supports(module)) is None:
                self._front = NativeTransformer(module)
            else:
                log.info("code2wav: the pre-transformer runs on torch ops (the C loop has no %s)", why)
            if (why := NativeUpsampler.supports(module)) is None:
                self._upsampler = NativeUpsampler(module)
            else:
                log.info("code2wav: the upsampler runs on torch ops (the C loop has no %s)", why)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The waveform [samples] of a whole utterance's codes [num_quantizers, T]."""
        if codes.shape[-1] == 0:
            return torch.zeros(0)
        hidden, _ = self._pre_transformer(codes, 0, None)
        return self._decoder(hidden)

    @torch.no_grad()
    def decode_chunk(
        self, stream: Code2WavStream, codes: torch.Tensor, left_context: int | None = None
    ) -> torch.Tensor:
        """The samples the next frames `codes` [num_quantizers, n] add to a streamed utterance.

        The pre-transformer continues from the carried keys and values (exactly as in the whole
        decode). Without `left_context`, every decoder convolution continues from its carried
        input tail too: each sample is computed once, from the same inputs as in the whole
        decode. With it, the decoder re-runs `left_context` earlier frames before the new ones
        (vllm-omni's way) and keeps only the new frames' samples; with `left_context >=
        geometry.decoder_frames` these equal the whole decode's as well."""
        count = codes.shape[-1]
        if count == 0:
            return torch.zeros(0)
        start = stream.frames
        hidden, stream.past = self._pre_transformer(codes, start, stream.past)
        if left_context is None:
            stream.frames += count
            return self._decoder(hidden, stream.carry)
        if stream.hidden_tail is not None and left_context > 0:
            hidden = torch.cat([stream.hidden_tail[-left_context:], hidden])
        wav = self._decoder(hidden)
        stream.hidden_tail = hidden[-max(left_context, 1) :]
        stream.frames += count
        # The first chunk's decode gives all its samples; a later chunk's left context yields the
        # samples before the new frames' own (at least one frame of context covers `trim`).
        return wav if start == 0 else wav[-count * self.geometry.samples_per_frame :]

    # -- stages ----------------------------------------------------------------------------------

    def _pre_transformer(self, codes: torch.Tensor, start: int, past):
        """Embedding and pre-transformer of frames from `start` on, continuing from `past` (the
        stream's carried keys and values, in the form the kernels in use keep them)."""
        if self._front is not None:
            return self._front(codes, start, past)
        return self._transformer(self._embed(codes), start, past)

    def _embed(self, codes: torch.Tensor) -> torch.Tensor:
        m = self.m
        return m.code_embedding(codes.unsqueeze(0) + m.code_offset).mean(1)[0]  # [T, hidden]

    def _decoder(self, hidden: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        """Upsampling and the convolutional decoder; `carry` (a stream's) holds each
        convolution's input tail from the previous chunk, None: zeros before the first frame."""
        m = self.m
        if self._upsampler is not None:
            x = self._upsampler(hidden, carry)
        else:
            x = hidden  # time-major [T, C] through the upsampling
            for transposed, convnext in m.upsample:
                x = self._upsample(transposed.conv, x)
                x = self._convnext(convnext, x, carry)
        if self._native is not None:
            return self._native(x, carry)
        x = x.t().contiguous()  # channel-major [C, T] through the decoder: time is the long side
        decoder = list(m.decoder)
        x = self._conv(decoder[0], x, carry)
        for block in decoder[1:-2]:
            snake, transposed, *residuals = block.block
            x = self._transposed(transposed, self._snake(snake, x), carry)
            for unit in residuals:
                y = self._conv(unit.conv1, self._snake(unit.act1, x), carry)
                y = self._conv(unit.conv2, self._snake(unit.act2, y), carry)
                x = x + y
        x = self._conv(decoder[-1], self._snake(decoder[-2], x), carry)
        return x.reshape(-1).clamp(min=-1, max=1)

    def _transformer(
        self, x: torch.Tensor, first_frame: int, past: list[tuple[torch.Tensor, torch.Tensor]] | None
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The pre-transformer on frames from `first_frame` on, continuing from `past` (each
        layer's rotated keys and values of up to `sliding_window - 1` earlier frames)."""
        model = self.m.pre_transformer
        positions = torch.arange(first_frame, first_frame + x.shape[0]).unsqueeze(0)
        cos, sin = model.rotary_emb(x.unsqueeze(0), positions)
        carried = []
        for index, layer in enumerate(model.layers[: self.config.num_hidden_layers]):
            h = bi.norm(layer.input_layernorm, x)
            attended, kv = self._attention(layer.self_attn, h, cos[0], sin[0], past[index] if past else None)
            carried.append(kv)
            x = x + layer.self_attn_layer_scale(attended)
            h = bi.norm(layer.post_attention_layernorm, x)
            mlp = layer.mlp
            h = tiled_linear(
                bi.activation(mlp.act_fn)(tiled_linear(h, mlp.gate_proj.weight))
                * tiled_linear(h, mlp.up_proj.weight),
                mlp.down_proj.weight,
            )
            x = x + layer.mlp_layer_scale(h)
        return bi.norm(model.norm, x), carried

    def _attention(
        self,
        attn,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        steps, d = x.shape[0], attn.head_dim
        q = tiled_linear(x, attn.q_proj.weight, attn.q_proj.bias).view(steps, -1, d)
        k = tiled_linear(x, attn.k_proj.weight, attn.k_proj.bias).view(steps, -1, d)
        v = tiled_linear(x, attn.v_proj.weight, attn.v_proj.bias).view(steps, -1, d)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        w = self.window
        if past is not None:
            k, v = torch.cat([past[0], k]), torch.cat([past[1], v])
        earlier = k.shape[0] - steps
        carried = (k[-(w - 1) :], v[-(w - 1) :]) if w > 1 else (k[:0], v[:0])
        heads, kv_heads = q.shape[1], k.shape[1]
        if kv_heads != heads:
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        # Each query gets exactly its window of W keys (itself and W - 1 before it); positions
        # before the utterance's first frame are padding, masked out.
        pad = w - 1 - earlier
        keys = F.pad(k, (0, 0, 0, 0, pad, 0)).unfold(0, w, 1)  # [T, heads, d, W]
        values = F.pad(v, (0, 0, 0, 0, pad, 0)).unfold(0, w, 1)
        valid = (torch.arange(steps).unsqueeze(1) + torch.arange(w).unsqueeze(0)) >= pad
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [T, heads, 1, d]
            keys.permute(0, 1, 3, 2).contiguous(),
            values.permute(0, 1, 3, 2).contiguous(),
            attn_mask=valid.view(steps, 1, 1, w),
            scale=attn.scaling,
        )
        return tiled_linear(out.reshape(steps, -1), attn.o_proj.weight, attn.o_proj.bias), carried

    # -- convolutions, time-major [T, C] ---------------------------------------------------------

    @staticmethod
    def _upsample(conv: torch.nn.ConvTranspose1d, x: torch.Tensor) -> torch.Tensor:
        """A transposed conv with kernel == stride: each input step makes `stride` output steps."""
        c_in, c_out, stride = conv.weight.shape
        weight = conv.weight.permute(1, 2, 0).reshape(c_out * stride, c_in)
        y = tiled_linear(x, weight).view(-1, c_out, stride) + conv.bias.view(1, c_out, 1)
        return y.permute(0, 2, 1).reshape(-1, c_out)

    @staticmethod
    def _transposed(module, x: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        """Qwen3-Omni's causal transposed conv (kernel 2s, stride s, s samples trimmed on each
        side), channel-major: output step t*s + k is input t's first half plus input t-1's second
        half. The utterance's first input makes no output of its own (trimmed); a later chunk's
        first input pairs with the previous chunk's last (carried)."""
        conv = module.conv
        c_in, c_out, kernel = conv.weight.shape
        stride = conv.stride[0]
        assert kernel == 2 * stride and module.left_pad == stride == module.right_pad
        weight = conv.weight.permute(1, 2, 0).reshape(c_out * kernel, c_in)
        y = column_product(weight, x).view(c_out, kernel, -1)
        first, second = y[:, :stride], y[:, stride:]
        previous = carry.get(module) if carry is not None else None
        if previous is None:
            out = first[:, :, 1:] + second[:, :, :-1] + conv.bias.view(c_out, 1, 1)
        else:
            out = first + torch.cat([previous, second[:, :, :-1]], dim=2) + conv.bias.view(c_out, 1, 1)
        if carry is not None:
            carry[module] = second[:, :, -1:]
        return out.permute(0, 2, 1).reshape(c_out, -1)  # [c_out, steps * stride]

    @staticmethod
    def _conv(module, x: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        """A left-padded stride-1 conv, channel-major: the bias, then each tap's product added in
        tap order into the same output (`addmm_`, each tap reading a shifted slice of the padded
        input). The padding is zeros before the utterance's first frame, else the carried tail of
        the previous chunk's input."""
        conv = module.conv
        assert conv.stride[0] == 1 and conv.groups == 1
        c_out, _, kernel = conv.weight.shape
        dilation = conv.dilation[0]
        channels, steps = x.shape
        halo = (kernel - 1) * dilation
        previous = carry.get(module) if carry is not None else None
        columns = max(steps, MIN_ROWS)  # see column_product
        padded = x.new_zeros((channels, halo + columns))
        if previous is not None:
            padded[:, :halo] = previous
        padded[:, halo : halo + steps] = x
        if carry is not None and halo:
            carry[module] = padded[:, steps : halo + steps].clone()  # the last `halo` inputs
        width = max(c_out, 2)
        weight = conv.weight if c_out == width else torch.cat([conv.weight, torch.zeros_like(conv.weight)])
        bias = conv.bias if c_out == width else torch.cat([conv.bias, conv.bias.new_zeros(1)])
        out = bias.unsqueeze(1).expand(width, columns).contiguous()
        for tap in range(kernel):
            out.addmm_(weight[:, :, tap], padded[:, tap * dilation : tap * dilation + columns])
        return out[:c_out, :steps]

    @staticmethod
    def _depthwise(module, x: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        """A left-padded depthwise conv, time-major: the taps' products summed in tap order."""
        conv = module.conv
        c_out, _, kernel = conv.weight.shape
        assert conv.stride[0] == 1 and conv.groups == c_out == x.shape[1]
        dilation = conv.dilation[0]
        steps, channels = x.shape
        halo = (kernel - 1) * dilation
        previous = carry.get(module) if carry is not None else None
        if previous is None:
            previous = x.new_zeros((halo, channels))
        padded = torch.cat([previous, x])
        if carry is not None and halo:
            carry[module] = padded[-halo:]
        out = padded[:steps] * conv.weight[:, 0, 0]
        for tap in range(1, kernel):
            out += padded[tap * dilation : tap * dilation + steps] * conv.weight[:, 0, tap]
        return out + conv.bias

    def _convnext(self, block, x: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        h = self._depthwise(block.dwconv, x, carry)
        h = bi.norm(block.norm, h)
        h = tiled_linear(
            block.act(tiled_linear(h, block.pwconv1.weight, block.pwconv1.bias)),
            block.pwconv2.weight,
            block.pwconv2.bias,
        )
        return x + block.gamma * h

    def _snake(self, module, x: torch.Tensor) -> torch.Tensor:
        """SnakeBeta on channel-major x [C, T]: x + 1/(exp(beta) + eps) * sin(x * exp(alpha))^2,
        the per-channel factors computed once per module, the rest in place on one buffer (the
        same operations in the same order as transformers', so the same bits)."""
        factors = self._snake_factors.get(module)
        if factors is None:
            factors = (
                torch.exp(module.alpha).unsqueeze(1),
                1.0 / (torch.exp(module.beta).unsqueeze(1) + module.no_div_by_zero),
            )
            self._snake_factors[module] = factors
        alpha, inverse = factors
        y = x * alpha
        y.sin_()
        y.mul_(y)
        y.mul_(inverse)
        return y.add_(x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding for x [T, heads, d] with cos/sin [T, d] (transformers' rotate_half)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
