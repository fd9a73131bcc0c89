"""Embedded models written out as checkpoint directories, for engines that load from disk (vLLM).

A directory is keyed by a hash of what it holds, built once per machine, and safe when several
processes ask at once: each builds into a private temporary directory and renames it into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

MARKER = "omni_pd_model.json"


def default_cache_root() -> Path:
    root = os.environ.get("OMNI_PD_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "omni-pd"


def content_key(what: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def cached_checkpoint(
    name: str, key: str, write: Callable[[Path], None], cache_root: str | os.PathLike | None = None
) -> Path:
    """The directory `<cache>/<name>-<key>`, written by `write(directory)` on first use."""
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / f"{name}-{key}"
    if (target / MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        write(scratch)
        (scratch / MARKER).write_text(json.dumps({"name": name, "key": key}))
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / MARKER).is_file():
                raise  # not a lost race: a real error
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target
