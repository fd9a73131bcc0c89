"""Planning. `pd.py`: the P/D pair of a pipeline and each request's two legs' sampling
parameters (pure: no I/O, never mutates its inputs). The rest is `omni-pd plan`: step costs
fitted to a profile, a simulator of the engine's step rule per layout, goodput under SLOs, and
predicted against measured (it reads files and may run a profile)."""

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
