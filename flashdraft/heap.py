"""Native heap upkeep for long-running decoding loops (the server, `prepare`, batched runs).

Every cycle allocates tensors whose sizes follow the batch (rows × width logits, prompt-length prefills). glibc
serves them from its heap and, as ever-new sizes arrive, keeps the freed pieces mapped: a server's RSS climbed for as
long as it ran (docs/bench/soak). malloc_trim hands the free pages back; every few seconds it costs nothing
measurable. Elsewhere than glibc this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

TRIM_EVERY_S = 5.0


def glibc() -> ctypes.CDLL | None:
    """The C library when it has malloc_trim (glibc), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


LIBC = glibc()
_last = time.monotonic()


def trim_heap(every_s: float = TRIM_EVERY_S) -> bool:
    """Return freed native memory to the OS if `every_s` seconds passed since the last trim; whether it trimmed."""
    global _last
    t = time.monotonic()
    if LIBC is None or t - _last < every_s:
        return False
    _last = t
    LIBC.malloc_trim(0)
    return True
