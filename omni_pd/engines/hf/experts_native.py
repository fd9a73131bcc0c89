"""An MoE layer's routed experts on the C kernel of native/experts.c.

Each expert some row picked runs on its rows only, every output element one dot product computed
alone (a fixed order of float operations), so a row's bits do not depend on its batch, on which
experts other rows picked, or on the thread count; the step reads only the experts in use. The
torch form of the same contract (`batch_invariant._routed_experts` on 16-row tiles) pads every
expert's rows to a tile: 2-2.5x the plain routed product's time at the real thinker's shapes,
where this kernel stays within the plain product's (docs: `omni-pd bench roofline`).
"""

from __future__ import annotations

import ctypes

import torch

from .native_build import SOURCES, NativeKernel, build_id, load

EXPERTS = NativeKernel(
    "experts", SOURCES / "experts.c", "the autoregressive stages' engine_args.attention_kernels: torch"
)

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_lib: ctypes.CDLL | None = None


def _library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load(EXPERTS)
        lib.omni_moe_experts.argtypes = [_P, _P, _P, _P, _P, _L, _P, _P, _L, _L, _P, _P, _I]
        lib.omni_moe_experts.restype = None
        _lib = lib
    return _lib


def check() -> None:
    """Build (or load) the kernel now: a missing compiler fails the stage at start."""
    _library()


def builds() -> dict[str, str]:
    return {EXPERTS.name: build_id(EXPERTS)}


def supports(module) -> bool:
    """Whether the kernel computes this layer: float32 on CPU, transformers' fused layout."""
    gate_up, down = module.gate_up_proj, module.down_proj
    return (
        gate_up.device.type == "cpu"
        and gate_up.dtype == down.dtype == torch.float32
        and gate_up.is_contiguous()
        and down.is_contiguous()
        and gate_up.dim() == 3
        and down.shape[2] * 2 == gate_up.shape[1]
    )


def routed_experts(
    module, x: torch.Tensor, pair_rows: torch.Tensor, pair_weights: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """transformers' fused experts on rows `x` ([rows, hidden]), given the step's routing pairs
    grouped by expert (`batch_invariant.routed_pairs`: each pair's row and weight, the pairs per
    expert); the act_fn is SiLU (the caller checks)."""
    count, hidden = x.shape
    inter = module.gate_up_proj.shape[1] // 2
    rows = pair_rows.to(torch.long).contiguous()
    weights = pair_weights.to(torch.float32).contiguous()
    used = torch.nonzero(counts).reshape(-1).to(torch.long).contiguous()
    starts = torch.zeros(used.numel() + 1, dtype=torch.long)
    torch.cumsum(counts[used], 0, out=starts[1:])
    xs = x.index_select(0, rows).contiguous()
    out = torch.zeros((count, hidden), dtype=torch.float32)
    scratch = torch.empty((rows.numel(), inter), dtype=torch.float32)
    _library().omni_moe_experts(
        xs.data_ptr(),
        module.gate_up_proj.data_ptr(),
        module.down_proj.data_ptr(),
        used.data_ptr(),
        starts.data_ptr(),
        used.numel(),
        rows.data_ptr(),
        weights.data_ptr(),
        hidden,
        inter,
        scratch.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
