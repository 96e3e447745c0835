"""Where the pinned llama.cpp build lives, and its tools."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import FlashdraftError
from ..paths import cache_root

LLAMACPP_VERSION = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp `make llamacpp` builds (Makefile)
HOW_TO_GET = "run `make llamacpp` (builds the pinned llama.cpp once) or set FLASHDRAFT_LLAMACPP to such a build"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # the weight types llama.cpp's converter writes that flashdraft offers


def home() -> Path:
    """Where the llama.cpp build lives: $FLASHDRAFT_LLAMACPP, else <flashdraft cache>/llamacpp/<version>."""
    env = os.environ.get("FLASHDRAFT_LLAMACPP")
    return Path(env) if env else cache_root() / "llamacpp" / LLAMACPP_VERSION


def tool(name: str) -> Path:
    """Path of a built llama.cpp tool (llama-server), or a one-line error saying how to build it."""
    path = home() / "bin" / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FlashdraftError(f"llama.cpp's {name} is not built in {home()}: {HOW_TO_GET}")
    return path


def converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py from the pinned source."""
    path = home() / "src" / "convert_hf_to_gguf.py"
    if not path.is_file():
        raise FlashdraftError(f"llama.cpp's convert_hf_to_gguf.py is not in {home() / 'src'}: {HOW_TO_GET}")
    return path
