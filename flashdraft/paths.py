"""Where flashdraft keeps what it converts and builds: targets, GGUF files, llama.cpp, its native kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$FLASHDRAFT_CACHE, else $XDG_CACHE_HOME/flashdraft, else ~/.cache/flashdraft."""
    if os.environ.get("FLASHDRAFT_CACHE"):
        return Path(os.environ["FLASHDRAFT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flashdraft"
