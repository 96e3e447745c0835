"""Native memory upkeep for long-running decoding loops (the server, `prepare`, batched runs).

A loop that serves many requests meets ever-new tensor shapes: every prompt length is a new prefill shape and every
rows × width a new verify shape. Two things then grow native memory for as long as it runs (docs/bench/soak):
- oneDNN's primitive cache and ideep's per-shape cache behind the packed linears keep up to 1024 shapes each, about
  0.3–0.5 MB a shape: `bound_shape_caches` caps both (a cycle needs a few dozen);
- glibc serves the batch-shaped buffers from its heap and keeps freed pieces mapped: `trim_heap` hands free pages
  back every few seconds (a no-op elsewhere than glibc).
"""

from __future__ import annotations

import os
import time

from .atomic import LIBC

TRIM_EVERY_S = 5.0
SHAPE_CACHE_CAPACITY = 64  # shapes per cache: a cycle's verify, drafter and prefill shapes, with room to spare
SHAPE_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's


def bound_shape_caches(capacity: int = SHAPE_CACHE_CAPACITY) -> None:
    """Cap the per-shape caches of the CPU linears; effective only before the first oneDNN call of the process. A
    value already in the environment wins."""
    for var in SHAPE_CACHES:
        os.environ.setdefault(var, str(capacity))


MALLOC_TRIM = getattr(LIBC, "malloc_trim", None) if LIBC is not None else None  # glibc only
_last = time.monotonic()


def trim_heap(every_s: float = TRIM_EVERY_S) -> bool:
    """Return freed native memory to the OS if `every_s` seconds passed since the last trim; whether it trimmed."""
    global _last
    t = time.monotonic()
    if MALLOC_TRIM is None or t - _last < every_s:
        return False
    _last = t
    MALLOC_TRIM(0)
    return True
