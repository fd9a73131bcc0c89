"""omni-pd: prefill/decode disaggregation for multi-stage omni models."""

from .sampling import SamplingParams

__all__ = ["Omni", "SamplingParams"]


def __getattr__(name: str):
    # Omni pulls in torch and transformers: import it only when asked for.
    if name == "Omni":
        from .orchestrator.omni import Omni

        return Omni
    raise AttributeError(name)
