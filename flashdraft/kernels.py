"""flashdraft's native CPU kernels (csrc/): the decode matmul (matvec.cpp), the lean forward's fused glue
(fused.cpp) and its ragged decode attention (attention.cpp), built once per machine with the system C++ compiler and loaded as torch.ops.flashdraft.*; without a
compiler, flashdraft runs on oneDNN's packed matmul and torch's own ops instead."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import time
from pathlib import Path

import torch

from .paths import cache_root

KERNEL_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("matvec.cpp", "fused.cpp",
                                                                               "attention.cpp")]
LIBRARY = "flashdraft_kernels"
# Built on and for this machine; OpenMP runs at::parallel_for; no errno lets `exp` vectorise (libmvec).
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]


def _machine() -> bytes:
    """What the built library depends on besides its source: torch, the compiler target, this CPU's features."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    flags = next((ln for ln in lines if ln.startswith(("flags", "Features"))), "")
    return f"{torch.__version__}|{platform.machine()}|{flags}".encode()


def library_dir() -> Path:
    """<flashdraft cache>/kernels/<hash of source, torch and CPU>: a new torch or machine builds afresh."""
    key = hashlib.sha256(b"".join(src.read_bytes() for src in KERNEL_SOURCES) + _machine()).hexdigest()[:16]
    return cache_root() / "kernels" / key


def _build(out: Path) -> None:
    """Compile into out/build (ninja under a lock, so concurrent processes wait) and load it; then publish the
    library at out/ with one rename, so a library found there is always whole."""
    from torch.utils.cpp_extension import load
    try:  # the ninja package's binary: `make` runs .venv/bin/python without the venv's bin on PATH
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    print("flashdraft: building the native CPU kernels for this machine (once, about 30 s)...", file=sys.stderr)
    start = time.perf_counter()
    build = out / "build"
    build.mkdir(parents=True, exist_ok=True)
    load(LIBRARY, [str(src) for src in KERNEL_SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
         build_directory=str(build), is_python_module=False)
    os.replace(build / f"{LIBRARY}.so", out / f"{LIBRARY}.so")
    print(f"flashdraft: built in {time.perf_counter() - start:.0f} s ({out})", file=sys.stderr)


def available() -> bool:
    """Whether torch.ops.flashdraft.* are loaded here (built on first use); FLASHDRAFT_KERNEL=0 turns them off."""
    return os.environ.get("FLASHDRAFT_KERNEL", "1") != "0" and _loaded()


@functools.cache
def _loaded() -> bool:
    return load_library()


def load_library() -> bool:
    """Load the library from its cache directory, building it there first if absent; False (and one line on
    stderr saying why) where it cannot be built."""
    try:
        out = library_dir()
        lib = out / f"{LIBRARY}.so"
        if lib.exists():
            torch.ops.load_library(str(lib))
        else:
            _build(out)
        return True
    except Exception as e:  # no compiler, no ninja, an unwritable cache: the oneDNN path still works
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        print(f"flashdraft: native CPU kernels unavailable ({reason[:200]}); using oneDNN's packed matmul, "
              "about 1.2x slower per decode step (needs g++ and ninja; FLASHDRAFT_KERNEL=0 skips the build)",
              file=sys.stderr)
        return False
