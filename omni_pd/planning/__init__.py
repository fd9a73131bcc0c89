"""Pure P/D planning: no I/O, no processes, never mutates its inputs (`omni-pd plan`, which
predicts layouts' goodput, is `omni_pd/plan/`)."""

from omni_pd.planning.pd import (
    REQUIRED_PREFILL_OUTPUT_KEYS,
    PDPair,
    build_decode_sampling_params,
    build_prefill_sampling_params,
    expand_sampling_params,
    find_pd_pair,
    new_transfer_id,
)

__all__ = [
    "REQUIRED_PREFILL_OUTPUT_KEYS",
    "PDPair",
    "build_decode_sampling_params",
    "build_prefill_sampling_params",
    "expand_sampling_params",
    "find_pd_pair",
    "new_transfer_id",
]
