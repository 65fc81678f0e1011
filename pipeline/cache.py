"""Where batchgen keeps what it builds once: dequantised GGUF weights and compiled C++ ops."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$BATCHGEN_CACHE, else $XDG_CACHE_HOME/batchgen, else ~/.cache/batchgen."""
    if os.environ.get("BATCHGEN_CACHE"):
        return Path(os.environ["BATCHGEN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batchgen"
