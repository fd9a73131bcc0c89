"""Version guard shared by the patches: each patch names the vLLM releases it was written for
and verified against; on any other release it refuses (logs why, once) instead of patching code
it has never seen."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

# Under vLLM's logger namespace so that plain vLLM processes (which configure only "vllm.*"
# loggers) show these lines too.
log = logging.getLogger("vllm.omni_pd.patches")

_lock = threading.Lock()
_results: dict[str, "PatchResult"] = {}


@dataclass(frozen=True)
class PatchResult:
    name: str
    status: str  # "applied" | "refused" | "not_needed"
    detail: str

    @property
    def ok(self) -> bool:
        return self.status in ("applied", "not_needed")


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def base_version(version: str) -> str:
    """'0.32.0+cpu' -> '0.32.0' (local build tags do not change the Python code)."""
    return version.split("+", 1)[0]


@dataclass(frozen=True)
class Patch:
    name: str
    what: str  # one line: what the patch changes
    supported: tuple[str, ...]  # vLLM base versions this patch was written for and tested on
    install: Callable[[], str | None]  # patches; returns None, or a reason it is not needed

    def apply(self) -> PatchResult:
        with _lock:
            done = _results.get(self.name)
            if done is not None:
                return done
            version = vllm_version()
            if base_version(version) not in self.supported:
                result = PatchResult(
                    self.name,
                    "refused",
                    (
                        f"omni-pd's vLLM fix '{self.name}' ({self.what}) was written for vLLM "
                        f"{', '.join(self.supported)}, but vLLM {version} is installed; it is NOT applied. "
                        f"Install a supported vLLM (`pip install 'omni-pd[vllm]'`) or port the fix "
                        f"(omni_pd/engines/vllm/patches/)."
                    ),
                )
                log.error("%s", result.detail)
            else:
                try:
                    reason = self.install()
                except Exception as exc:  # the code moved under us: refuse, do not half-patch
                    result = PatchResult(
                        self.name,
                        "refused",
                        f"omni-pd's vLLM fix '{self.name}' could not be applied to "
                        f"vLLM {version}: {type(exc).__name__}: {exc}",
                    )
                    log.error("%s", result.detail)
                else:
                    if reason is None:
                        result = PatchResult(self.name, "applied", f"{self.what} (vLLM {version})")
                        log.info("omni-pd patched vLLM: %s", result.detail)
                    else:
                        result = PatchResult(self.name, "not_needed", reason)
                        log.info("omni-pd fix '%s' not needed: %s", self.name, reason)
            _results[self.name] = result
            return result


def results() -> dict[str, PatchResult]:
    with _lock:
        return dict(_results)


def mark_patched(obj, attr: str, replacement) -> None:
    """Replace obj.attr, keeping the original on the replacement for tests and for un-patching."""
    original = getattr(obj, attr)
    if getattr(original, "__omni_pd_patch__", False):
        return
    replacement.__omni_pd_patch__ = True
    replacement.__wrapped__ = original
    setattr(obj, attr, replacement)
