"""Let torchvision import under a CPU-only torch, in every process of the venv.

vLLM's multimodal model files (the omni thinkers among them) reach torchvision through
transformers' image processors, and `import vllm.config` already does. The registry's torchvision
wheels are CUDA builds: under the CPU torch their compiled ops (`torchvision/_C.so`) do not load,
and `import torchvision` then dies on `operator torchvision::nms does not exist`, because two of
its ops (`nms`, `qnms`) are given fake kernels without a check that they exist. Defining their
two schemas first is enough for the import; the ops are never called on this path (no detection
models run), and calling one fails loudly (no kernel).

vLLM loads its plugins only after `vllm.config` is imported, too late for this, and it starts
subprocesses of its own (`python -m vllm.model_executor.models.registry`, engine cores,
workers). So `scripts/setup.sh` writes a `.pth` file into the venv that imports this module at
every interpreter start. The import costs no more than installing `_BeforeTorchvision`: torch is
imported, and the check made, only when something first imports torchvision.

Guarded: where torchvision's compiled ops load (a CUDA torch with its matching torchvision, or a
CPU build of torchvision), they are registered as usual and nothing is defined here.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)

# The ops torchvision registers fake kernels for without checking that they exist.
UNGUARDED_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None  # the torch.library.Library holding the schemas: kept alive for the process


def compiled_ops_load(package_dir: Path) -> bool:
    """Whether torchvision's compiled ops load into this torch (they then register themselves)."""
    import torch

    for lib in sorted(package_dir.glob("_C*.so")) + sorted(package_dir.glob("_C*.pyd")):
        try:
            torch.ops.load_library(str(lib))
            return True
        except (OSError, RuntimeError) as exc:
            log.debug("torchvision's compiled ops do not load here (%s)", exc)
            return False
    return False


def define_missing_ops() -> bool:
    """Define the unguarded ops' schemas unless torchvision's own ops load. True if defined."""
    global _library
    spec = importlib.util.find_spec("torchvision")
    if _library is not None or spec is None or not spec.submodule_search_locations:
        return False
    if compiled_ops_load(Path(next(iter(spec.submodule_search_locations)))):
        return False
    import torch

    library = torch.library.Library("torchvision", "DEF")
    for schema in UNGUARDED_OPS:
        library.define(schema)
    _library = library
    log.debug(
        "torchvision's compiled ops do not load under torch %s: defined the schemas of %s so that it imports",
        torch.__version__,
        ", ".join(s.split("(")[0] for s in UNGUARDED_OPS),
    )
    return True


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs `define_missing_ops` once, just before the first `import torchvision`, then steps
    aside: the regular finders import torchvision itself."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision":
            return None
        uninstall()
        try:
            define_missing_ops()
        except Exception:  # never break an import that might have worked without us
            log.exception("could not prepare torchvision's ops for a CPU torch")
        return None


def install() -> None:
    """Arm the hook (the `.pth` file calls this through the import below). Idempotent."""
    if "torchvision" in sys.modules or any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _BeforeTorchvision())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _BeforeTorchvision)]


install()
