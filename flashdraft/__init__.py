"""flashdraft: lossless speculative decoding with block-diffusion (DFlash) drafters.

The API below loads on first use (PEP 562): `import flashdraft` and the command line's `--help` and argument errors
import no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import FlashdraftError

if TYPE_CHECKING:
    from .api import generate, generate_batch
    from .checkpoint import load_drafter, save_drafter
    from .decoding import DecodeSettings, GenerationResult, generate_ids
    from .models import Target, load_drafter_for, load_target

# public name → the module that defines it, imported when the name is first used
LAZY = {"generate": ".api", "generate_batch": ".api", "load_drafter": ".checkpoint", "save_drafter": ".checkpoint",
        "DecodeSettings": ".decoding", "GenerationResult": ".decoding", "generate_ids": ".decoding",
        "Target": ".models", "load_drafter_for": ".models", "load_target": ".models"}

__all__ = ["generate", "generate_batch", "generate_ids", "DecodeSettings", "load_target", "load_drafter",
           "load_drafter_for", "save_drafter", "GenerationResult", "FlashdraftError", "Target"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in LAZY:
        raise AttributeError(f"module 'flashdraft' has no attribute {name!r}")
    value = getattr(importlib.import_module(LAZY[name], __name__), name)
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(LAZY))
