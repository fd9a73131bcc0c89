"""code2wav's convolutional decoder on the C kernels of native/code2wav.c.

The same layers as `ExactCode2Wav._decoder`'s torch path (SnakeBeta, causal convolutions, the
causal transposed convolutions, the residual units), channel-major, with the decoder's
arithmetic in one pass per layer instead of several torch ops: about 2x faster per utterance on
CPU, where code2wav is the largest share of a request's CPU time. Like the torch path, a sample's
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
    lib.omni_c2w_snake.argtypes = [_P, _L, _P, _L, _P, _P, _I, _L]
    lib.omni_c2w_snake.restype = None
    lib.omni_c2w_conv.argtypes = [_P, _L, _P, _L, _P, _P, _P, _L, _I, _I, _I, _I, _L]
    lib.omni_c2w_conv.restype = None
    lib.omni_c2w_residual_unit.argtypes = [_P, _L, _P, _L, _P, _L, _P, _P, _P, _P, _P, _I, _I,
                                           _P, _P, _P, _P, _I, _L]
    lib.omni_c2w_residual_unit.restype = None
    return lib


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

    key: object  # the module whose input tail a stream carries
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
    def of(cls, key, weight: torch.Tensor, bias: torch.Tensor, dilation: int = 1) -> "_Conv":
        weight, bias = weight.detach().float(), bias.detach().float()
        c_out = weight.shape[0]
        rows = -(-c_out // 4) * 4
        if rows != c_out:
            weight = torch.cat([weight, weight.new_zeros((rows - c_out, *weight.shape[1:]))])
            bias = torch.cat([bias, bias.new_zeros(rows - c_out)])
        return cls(key, weight.contiguous(), bias.contiguous(), c_out, weight.shape[2], dilation)


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
        return cls(_Conv.of(module, weight, bias), c_out, stride)


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
    return _Conv.of(module, conv.weight, conv.bias, conv.dilation[0])


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

    def __call__(self, hidden: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        """The samples for `hidden` [T, C] (time-major, after the upsampling), clamped to
        [-1, 1]; `carry` as in `ExactCode2Wav._decoder`."""
        steps = hidden.shape[0]
        x = hidden.new_zeros((hidden.shape[1], _width(steps)))
        x[:, :steps] = hidden.t()
        x = self._conv(self.first, x, steps, carry)
        for block in self.blocks:
            x, steps = self._transposed(block, x, steps, carry)
            for unit in block.units:
                x = self._unit(unit, x, steps, carry)
        wav = self._conv(self.last, x, steps, carry, self.last_snake)
        return wav[0, :steps].clamp(min=-1, max=1)

    @staticmethod
    def _padded(key, x: torch.Tensor, channels: int, halo: int, width: int,
                carry: dict | None) -> torch.Tensor:
        """A layer's input buffer [channels, halo + width], its first `halo` columns the carried
        input tail of the previous chunk (zeros before the utterance's first frame)."""
        padded = x.new_empty((channels, halo + width))
        previous = carry.get(key) if carry is not None else None
        if previous is None:
            padded[:, :halo] = 0
        else:
            padded[:, :halo] = previous
        return padded

    @staticmethod
    def _keep_tail(key, padded: torch.Tensor, steps: int, halo: int, carry: dict | None) -> None:
        if carry is not None and halo:
            carry[key] = padded[:, steps:steps + halo].clone()  # the last `halo` inputs

    def _conv(self, spec: _Conv, x: torch.Tensor, steps: int, carry: dict | None,
              snake: _Snake | None = None) -> torch.Tensor:
        """`spec` over `snake(x)` (or x), left-padded as `_padded` says."""
        width, halo = _width(steps), spec.halo
        padded = self._padded(spec.key, x, spec.c_in, halo, width, carry)
        body = padded[:, halo:]
        if snake is None:
            body.copy_(x[:, :width])
        else:
            self.lib.omni_c2w_snake(x.data_ptr(), x.stride(0), body.data_ptr(), padded.stride(0),
                                    snake.alpha.data_ptr(), snake.inverse.data_ptr(), spec.c_in, width)
        body[:, steps:] = 0
        self._keep_tail(spec.key, padded, steps, halo, carry)
        out = x.new_empty((spec.weight.shape[0], width))
        self.lib.omni_c2w_conv(padded.data_ptr(), padded.stride(0), out.data_ptr(), out.stride(0),
                               spec.weight.data_ptr(), spec.bias.data_ptr(), None, 0,
                               spec.c_in, spec.weight.shape[0], spec.kernel, spec.dilation, width)
        return out

    def _unit(self, unit: _Unit, x: torch.Tensor, steps: int, carry: dict | None) -> torch.Tensor:
        """A residual unit, x + conv2(snake2(conv1(snake1(x)))), in one pass over time (the same
        values as its layers one by one through `_conv`)."""
        conv1, conv2 = unit.conv1, unit.conv2
        width, halo, channels = _width(steps), conv1.halo, conv1.c_in
        padded = self._padded(conv1.key, x, channels, halo, width, carry)
        out = x.new_empty((channels, width))
        scratch = x.new_empty((channels, ALIGN))
        self.lib.omni_c2w_residual_unit(
            x.data_ptr(), x.stride(0), padded.data_ptr(), padded.stride(0), out.data_ptr(),
            out.stride(0), scratch.data_ptr(), unit.snake1.alpha.data_ptr(),
            unit.snake1.inverse.data_ptr(), conv1.weight.data_ptr(), conv1.bias.data_ptr(),
            conv1.kernel, conv1.dilation, unit.snake2.alpha.data_ptr(), unit.snake2.inverse.data_ptr(),
            conv2.weight.data_ptr(), conv2.bias.data_ptr(), channels, width)
        self._keep_tail(conv1.key, padded, steps, halo, carry)
        return out

    def _transposed(self, block: _Block, x: torch.Tensor, steps: int, carry: dict | None
                    ) -> tuple[torch.Tensor, int]:
        spec, stride, c_out = block.transposed.conv, block.transposed.stride, block.transposed.c_out
        starts = carry is None or carry.get(spec.key) is None  # the utterance's first input
        y = self._conv(spec, x, steps, carry, block.snake)
        phases = y[:, :steps].view(c_out, stride, steps).permute(0, 2, 1)  # [c_out, steps, s]
        if starts:
            phases = phases[:, 1:]  # the first input makes no output of its own (trimmed)
        samples = phases.shape[1] * stride
        out = x.new_empty((c_out, _width(samples)))
        out[:, :samples].view(c_out, -1, stride).copy_(phases)
        out[:, samples:] = 0
        return out, samples
