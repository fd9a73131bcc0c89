"""code2wav's convolutional decoder on the C kernels of native/code2wav.c.

The same layers as `ExactCode2Wav._decoder`'s torch path (SnakeBeta, causal convolutions, the
causal transposed convolutions, the residual units), channel-major, with the decoder's
arithmetic in one pass per layer instead of several torch ops: about 2x faster per utterance on
CPU, where code2wav is the largest share of a request's CPU time. The whole decoder is one C call
per chunk (`omni_c2w_decode`, over a layer table built once): calling the layers one by one from
Python cost 0.27 ms of glue per chunk, a tenth of a streamed request's decode. Like the torch path, a sample's
bits do not depend on how many frames one call decodes (see the C file), so streamed chunks add
up to the whole utterance exactly; the two paths differ from each other (and from transformers)
in the last bits only.

Buffers are `[channels, width]` with `width` the step count rounded up to `ALIGN`: the kernels
compute whole vectors and never a scalar tail. Columns past the step count are zeros on input
to a convolution and ignored on output.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from omni_pd.engines.hf.native_build import NativeKernel, load

CODE2WAV = NativeKernel(
    "code2wav",
    Path(__file__).resolve().parent / "native" / "code2wav.c",
    "the code2wav stage's engine_args.code2wav_kernels: torch",
)

ALIGN = 32  # the conv kernel's step: two vectors of 16 time steps

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


def _width(steps: int) -> int:
    return -(-steps // ALIGN) * ALIGN


@functools.cache
def _library() -> ctypes.CDLL:
    lib = load(CODE2WAV)
    # The layer kernels are called from omni_c2w_decode; declared for the tests, which check
    # them one by one.
    lib.omni_c2w_snake.argtypes = [_P, _L, _P, _L, _P, _P, _I, _L]
    lib.omni_c2w_snake.restype = None
    lib.omni_c2w_conv.argtypes = [_P, _L, _P, _L, _P, _P, _P, _L, _I, _I, _I, _I, _L]
    lib.omni_c2w_conv.restype = None
    lib.omni_c2w_decode.argtypes = [_P, _I, _P, _I, _L, _P, _I, _P]
    lib.omni_c2w_decode.restype = _L
    return lib


class _Layer(ctypes.Structure):
    """One decoder layer for `omni_c2w_decode` (native/code2wav.c's `c2w_layer`)."""

    _fields_ = [
        ("kind", _I),
        ("c_in", _I),
        ("rows", _I),
        ("c_out", _I),
        ("kernel", _I),
        ("dilation", _I),
        ("stride", _I),
        ("carry", _L),
        ("w", _P),
        ("b", _P),
        ("alpha", _P),
        ("inv", _P),
        ("w2", _P),
        ("b2", _P),
        ("alpha2", _P),
        ("inv2", _P),
    ]


_CONV, _TRANSPOSED, _UNIT, _SNAKE_CONV = 0, 1, 2, 3


@dataclass(frozen=True)
class _Snake:
    alpha: torch.Tensor  # exp(module.alpha) [C]
    inverse: torch.Tensor  # 1 / (exp(module.beta) + eps) [C]

    @classmethod
    def of(cls, module) -> "_Snake":
        alpha = torch.exp(module.alpha.detach().float()).contiguous()
        inverse = (1.0 / (torch.exp(module.beta.detach().float()) + module.no_div_by_zero)).contiguous()
        return cls(alpha, inverse)


@dataclass(frozen=True)
class _Conv:
    """A causal convolution's weights for the kernel: [rows, c_in, kernel], rows the outputs
    rounded up to 4 with zero rows."""

    weight: torch.Tensor
    bias: torch.Tensor
    c_out: int
    kernel: int
    dilation: int

    @property
    def c_in(self) -> int:
        return self.weight.shape[1]

    @property
    def halo(self) -> int:
        return (self.kernel - 1) * self.dilation

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor, dilation: int = 1) -> "_Conv":
        weight, bias = weight.detach().float(), bias.detach().float()
        c_out = weight.shape[0]
        rows = -(-c_out // 4) * 4
        if rows != c_out:
            weight = torch.cat([weight, weight.new_zeros((rows - c_out, *weight.shape[1:]))])
            bias = torch.cat([bias, bias.new_zeros(rows - c_out)])
        return cls(weight.contiguous(), bias.contiguous(), c_out, weight.shape[2], dilation)


@dataclass(frozen=True)
class _Transposed:
    """Qwen3-Omni's causal transposed conv (kernel 2s, stride s, trimmed s on each side) as a
    two-tap convolution at the input rate with c_out * s outputs: output (o, j) at input step t
    is sample t*s + j, from input t (taps [:s]) and input t - 1 (taps [s:])."""

    conv: _Conv
    c_out: int
    stride: int

    @classmethod
    def of(cls, module) -> "_Transposed":
        conv = module.conv
        c_in, c_out, kernel = conv.weight.shape
        stride = conv.stride[0]
        assert kernel == 2 * stride and module.left_pad == stride == module.right_pad
        w = conv.weight.detach().float()  # [c_in, c_out, 2s]
        earlier = w[:, :, stride:].permute(1, 2, 0).reshape(c_out * stride, c_in)
        current = w[:, :, :stride].permute(1, 2, 0).reshape(c_out * stride, c_in)
        weight = torch.stack([earlier, current], dim=2)  # tap 0 reads t - 1, tap 1 reads t
        bias = conv.bias.detach().float().repeat_interleave(stride)
        return cls(_Conv.of(weight, bias), c_out, stride)


@dataclass(frozen=True)
class _Unit:
    snake1: _Snake
    conv1: _Conv
    snake2: _Snake
    conv2: _Conv


@dataclass(frozen=True)
class _Block:
    snake: _Snake
    transposed: _Transposed
    units: tuple[_Unit, ...]


def _conv_of(module) -> _Conv:
    conv = module.conv
    assert conv.stride[0] == 1 and conv.groups == 1
    return _Conv.of(conv.weight, conv.bias, conv.dilation[0])


class NativeDecoder:
    """The decoder of a `Qwen3OmniMoeCode2Wav` (`module.decoder`) on the C kernels."""

    def __init__(self, module: torch.nn.Module):
        self.lib = _library()
        decoder = list(module.decoder)
        self.first = _conv_of(decoder[0])
        self.blocks = []
        for block in decoder[1:-2]:
            snake, transposed, *residuals = block.block
            units = tuple(
                _Unit(_Snake.of(u.act1), _conv_of(u.conv1), _Snake.of(u.act2), _conv_of(u.conv2))
                for u in residuals
            )
            for unit in units:  # the fused unit kernel's shape: c -> c -> c, c a multiple of 4
                assert unit.conv1.c_out == unit.conv1.c_in == unit.conv2.c_out and unit.conv1.c_in % 4 == 0
            self.blocks.append(_Block(_Snake.of(snake), _Transposed.of(transposed), units))
        self.last_snake = _Snake.of(decoder[-2])
        self.last = _conv_of(decoder[-1])
        self._plan()

    def _plan(self) -> None:
        """The layers as one array for `omni_c2w_decode`, and where each keeps its input tail in
        a stream's carry buffer ([c_in, halo] per layer, back to back)."""
        layers: list[_Layer] = []
        offset = 0

        def add(
            kind: int,
            conv: _Conv,
            snake: _Snake | None = None,
            c_out: int | None = None,
            stride: int = 1,
            unit: _Unit | None = None,
        ) -> None:
            nonlocal offset
            layer = _Layer(
                kind,
                conv.c_in,
                conv.weight.shape[0],
                conv.c_out if c_out is None else c_out,
                conv.kernel,
                conv.dilation,
                stride,
                offset,
                conv.weight.data_ptr(),
                conv.bias.data_ptr(),
                snake.alpha.data_ptr() if snake else None,
                snake.inverse.data_ptr() if snake else None,
            )
            if unit is not None:
                layer.w2, layer.b2 = unit.conv2.weight.data_ptr(), unit.conv2.bias.data_ptr()
                layer.alpha2, layer.inv2 = unit.snake2.alpha.data_ptr(), unit.snake2.inverse.data_ptr()
            layers.append(layer)
            offset += conv.c_in * conv.halo

        add(_CONV, self.first)
        self.strides = 1
        for block in self.blocks:
            spec = block.transposed
            add(_TRANSPOSED, spec.conv, block.snake, c_out=spec.c_out, stride=spec.stride)
            self.strides *= spec.stride
            for unit in block.units:
                add(_UNIT, unit.conv1, unit.snake1, unit=unit)
        add(_SNAKE_CONV, self.last, self.last_snake)
        self.layers = (_Layer * len(layers))(*layers)  # points into the weights this object holds
        self.carry_floats = offset

    def __call__(self, hidden: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        """The samples for `hidden` [T, C] (time-major, after the upsampling), clamped to
        [-1, 1]; `carry` as in `ExactCode2Wav._decoder` (this decoder keeps one buffer there, the
        input tail of every layer), None: zeros before the first frame, nothing kept."""
        hidden = hidden.detach().float().contiguous()
        steps, channels = hidden.shape
        tails, started = _carried(carry, self, self.carry_floats)
        out = torch.empty(steps * self.strides)
        count = self.lib.omni_c2w_decode(
            ctypes.addressof(self.layers),
            len(self.layers),
            hidden.data_ptr(),
            channels,
            steps,
            None if tails is None else tails.data_ptr(),
            int(started),
            out.data_ptr(),
        )
        if count < 0:
            raise MemoryError(f"code2wav's native decoder could not allocate buffers for {steps} steps")
        return out[:count]


# -- before the decoder: the pre-transformer and the upsampler -----------------------------------

_F = ctypes.c_float


class _TLayer(ctypes.Structure):
    _fields_ = [
        (name, _P)
        for name in (
            "in_norm",
            "wq",
            "wk",
            "wv",
            "wo",
            "attn_scale",
            "post_norm",
            "wg",
            "wu",
            "wd",
            "mlp_scale",
        )
    ]


class _TParams(ctypes.Structure):
    _fields_ = [
        ("layers", _I),
        ("hidden", _I),
        ("heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
        ("inter", _I),
        ("window", _I),
        ("quantizers", _I),
        ("eps", _F),
        ("scaling", _F),
        ("rope_scaling", _F),
        ("embed", _P),
        ("offsets", _P),
        ("inv_freq", _P),
        ("final_norm", _P),
        ("layer", _P),
    ]


class _UpBlock(ctypes.Structure):
    _fields_ = [("c", _I), ("stride", _I), ("inter", _I), ("kernel", _I), ("eps", _F)] + [
        (name, _P)
        for name in ("up_w", "up_b", "dw_w", "dw_b", "ln_w", "ln_b", "pw1", "pw1_b", "pw2", "pw2_b", "gamma")
    ]


@functools.cache
def _front_library() -> ctypes.CDLL:
    lib = _library()
    lib.omni_c2w_transformer.argtypes = [_P, _P, _L, _L, _L, _P, _L, _P]
    lib.omni_c2w_transformer.restype = _L
    lib.omni_c2w_upsample.argtypes = [_P, _I, _P, _L, _P, _P]
    lib.omni_c2w_upsample.restype = _L
    return lib


class _Pinned:
    """The contiguous copies (float32 unless told) of the tensors a C table points into, kept
    alive with it."""

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor, dtype: torch.dtype = torch.float32) -> int:
        t = t.detach().to(dtype).contiguous()
        self._tensors.append(t)
        return t.data_ptr()


def _carried(carry: dict | None, key: object, floats: int) -> tuple[torch.Tensor | None, bool]:
    """`key`'s tail buffer in a stream's `carry` (zeros, made now, at the stream's first chunk)
    and whether the stream had one already; (None, False) without a stream."""
    if carry is None:
        return None, False
    tails = carry.get(key)
    if tails is not None:
        return tails, True
    tails = carry[key] = torch.zeros(floats)
    return tails, False


class NativeTransformer:
    """code2wav's embedding and pre-transformer (`module.pre_transformer`) on the C loop:
    per frame, over exactly its sliding window of keys (carried between chunks in one buffer,
    [layers, 2, window - 1, kv_heads * head_dim])."""

    def __init__(self, module: torch.nn.Module):
        config = module.config
        model = module.pre_transformer
        layers = list(model.layers[: config.num_hidden_layers])
        attn = layers[0].self_attn
        self.hidden = config.hidden_size
        self.kv_width = attn.k_proj.out_features
        self.carried = config.sliding_window - 1
        self.num_layers = len(layers)
        ptr = self._pinned = _Pinned()
        table = []
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            table.append(
                _TLayer(
                    ptr(layer.input_layernorm.weight),
                    ptr(a.q_proj.weight.t()),
                    ptr(a.k_proj.weight.t()),
                    ptr(a.v_proj.weight.t()),
                    ptr(a.o_proj.weight.t()),
                    ptr(layer.self_attn_layer_scale.scale),
                    ptr(layer.post_attention_layernorm.weight),
                    ptr(m.gate_proj.weight.t()),
                    ptr(m.up_proj.weight.t()),
                    ptr(m.down_proj.weight.t()),
                    ptr(layer.mlp_layer_scale.scale),
                )
            )
        self._layers = (_TLayer * len(table))(*table)
        rotary = model.rotary_emb
        self.params = _TParams(
            self.num_layers,
            self.hidden,
            config.num_attention_heads,
            config.num_key_value_heads,
            attn.head_dim,
            layers[0].mlp.gate_proj.out_features,
            config.sliding_window,
            module.code_offset.numel(),
            layers[0].input_layernorm.variance_epsilon,
            attn.scaling,
            float(rotary.attention_scaling),
            ptr(module.code_embedding.weight),
            ptr(module.code_offset.reshape(-1), torch.long),
            ptr(rotary.inv_freq),
            ptr(model.norm.weight),
            ctypes.addressof(self._layers),
        )
        self.lib = _front_library()

    @staticmethod
    def supports(module: torch.nn.Module) -> str | None:
        """Why this module's pre-transformer cannot run here (None: it can)."""
        config = module.config
        model = module.pre_transformer
        layer = model.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        widths = (
            config.hidden_size,
            attn.q_proj.out_features,
            attn.k_proj.out_features,
            mlp.gate_proj.out_features,
        )
        if any(w % 16 for w in widths):
            return f"widths {widths} are not multiples of 16"
        if any(
            p.bias is not None
            for p in (
                attn.q_proj,
                attn.k_proj,
                attn.v_proj,
                attn.o_proj,
                mlp.gate_proj,
                mlp.up_proj,
                mlp.down_proj,
            )
        ):
            return "projections with biases"
        if not all(isinstance(n, torch.nn.Identity) for n in (attn.q_norm, attn.k_norm)):
            return "q/k norms"
        if getattr(model.rotary_emb, "rope_type", "default") != "default":
            return f"rope type {model.rotary_emb.rope_type}"
        if model.norm.variance_epsilon != layer.input_layernorm.variance_epsilon:
            return "norms with different epsilons"
        if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            return f"activation {type(mlp.act_fn).__name__}"
        return None

    def __call__(
        self, codes: torch.Tensor, start: int, kv: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [n, hidden] of frames start .. start + n - 1 (codes [quantizers, n]),
        and the key/value buffer for the next chunk (`kv` updated, or a new one at start 0)."""
        codes = codes.to(torch.long).contiguous()
        steps = codes.shape[1]
        if kv is None:
            kv = torch.zeros((self.num_layers, 2, self.carried, self.kv_width))
        out = torch.empty((steps, self.hidden))
        status = self.lib.omni_c2w_transformer(
            ctypes.byref(self.params),
            codes.data_ptr(),
            codes.stride(0),
            steps,
            start,
            kv.data_ptr(),
            min(start, self.carried),
            out.data_ptr(),
        )
        if status < 0:
            raise MemoryError(
                f"code2wav's native pre-transformer could not allocate buffers for {steps} frames"
            )
        return out, kv


class NativeUpsampler:
    """code2wav's upsampler (`module.upsample`: transposed conv with kernel == stride, then a
    ConvNeXt block, per stage) on the C loop, time-major; a stream carries each ConvNeXt's
    depthwise input tail (one buffer, kept in its carry dict under this object)."""

    def __init__(self, module: torch.nn.Module):
        ptr = self._pinned = _Pinned()

        blocks = []
        self.stride = 1
        for transposed, convnext in module.upsample:
            conv, dw = transposed.conv, convnext.dwconv.conv
            c_in, c_out, kernel = conv.weight.shape
            blocks.append(
                _UpBlock(
                    c_out,
                    kernel,
                    convnext.pwconv1.out_features,
                    dw.kernel_size[0],
                    convnext.norm.eps,
                    ptr(conv.weight.permute(2, 0, 1)),
                    ptr(conv.bias),
                    ptr(dw.weight.reshape(c_out, -1)),
                    ptr(dw.bias),
                    ptr(convnext.norm.weight),
                    ptr(convnext.norm.bias),
                    ptr(convnext.pwconv1.weight.t()),
                    ptr(convnext.pwconv1.bias),
                    ptr(convnext.pwconv2.weight.t()),
                    ptr(convnext.pwconv2.bias),
                    ptr(convnext.gamma),
                )
            )
            self.stride *= kernel
        self.channels = blocks[0].c
        self.carry_floats = sum((b.kernel - 1) * b.c for b in blocks)
        self._blocks = (_UpBlock * len(blocks))(*blocks)
        self.lib = _front_library()

    @staticmethod
    def supports(module: torch.nn.Module) -> str | None:
        widths = set()
        for transposed, convnext in module.upsample:
            conv, dw = transposed.conv, convnext.dwconv.conv
            c_in, c_out, kernel = conv.weight.shape
            if kernel != conv.stride[0] or transposed.left_pad or transposed.right_pad:
                return "a transposed convolution whose kernel is not its stride"
            if dw.groups != c_out or dw.stride[0] != 1 or dw.dilation[0] != 1:
                return "a ConvNeXt convolution that is not depthwise, stride 1, dilation 1"
            if (
                type(convnext.act).__name__ != "GELU"
                or getattr(convnext.act, "approximate", "none") != "none"
            ):
                return f"ConvNeXt activation {convnext.act}"
            widths.update((c_in, c_out, convnext.pwconv1.out_features))
        if any(w % 16 for w in widths):
            return f"widths {sorted(widths)} are not multiples of 16"
        stages = [
            (t.conv.weight.shape[0], t.conv.weight.shape[1], c.pwconv1.out_features)
            for t, c in module.upsample
        ]
        if len(set(stages)) != 1 or stages[0][0] != stages[0][1]:
            return "stages of different widths"
        return None

    def __call__(self, hidden: torch.Tensor, carry: dict | None) -> torch.Tensor:
        """[steps * stride, channels] from hidden [steps, channels]; `carry` as the decoder's."""
        hidden = hidden.detach().float().contiguous()
        tails, _ = _carried(carry, self, self.carry_floats)
        out = torch.empty((hidden.shape[0] * self.stride, self.channels))
        rows = self.lib.omni_c2w_upsample(
            ctypes.addressof(self._blocks),
            len(self._blocks),
            hidden.data_ptr(),
            hidden.shape[0],
            None if tails is None else tails.data_ptr(),
            out.data_ptr(),
        )
        if rows < 0:
            raise MemoryError(
                f"code2wav's native upsampler could not allocate buffers for {hidden.shape[0]} steps"
            )
        return out[:rows]
