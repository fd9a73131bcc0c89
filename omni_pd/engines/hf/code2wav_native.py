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
from dataclasses import dataclass

import torch

from .native_build import load

ALIGN = 32  # the conv kernel's step: two vectors of 16 time steps

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


def _width(steps: int) -> int:
    return -(-steps // ALIGN) * ALIGN


def _library() -> ctypes.CDLL:
    lib = load("code2wav")
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

    _fields_ = [("kind", _I), ("c_in", _I), ("rows", _I), ("c_out", _I), ("kernel", _I),
                ("dilation", _I), ("stride", _I), ("carry", _L),
                ("w", _P), ("b", _P), ("alpha", _P), ("inv", _P),
                ("w2", _P), ("b2", _P), ("alpha2", _P), ("inv2", _P)]


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
            units = tuple(_Unit(_Snake.of(u.act1), _conv_of(u.conv1), _Snake.of(u.act2),
                                _conv_of(u.conv2)) for u in residuals)
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

        def add(kind: int, conv: _Conv, snake: _Snake | None = None, c_out: int | None = None,
                stride: int = 1, unit: _Unit | None = None) -> None:
            nonlocal offset
            layer = _Layer(kind, conv.c_in, conv.weight.shape[0], conv.c_out if c_out is None else c_out,
                           conv.kernel, conv.dilation, stride, offset,
                           conv.weight.data_ptr(), conv.bias.data_ptr(),
                           snake.alpha.data_ptr() if snake else None,
                           snake.inverse.data_ptr() if snake else None)
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
        tails = carry.get(self) if carry is not None else None
        started = tails is not None
        if carry is not None and tails is None:
            tails = carry[self] = torch.zeros(self.carry_floats)
        out = torch.empty(steps * self.strides)
        count = self.lib.omni_c2w_decode(ctypes.addressof(self.layers), len(self.layers),
                                         hidden.data_ptr(), channels, steps,
                                         None if tails is None else tails.data_ptr(), int(started),
                                         out.data_ptr())
        if count < 0:
            raise MemoryError(f"code2wav's native decoder could not allocate buffers for {steps} steps")
        return out[:count]
