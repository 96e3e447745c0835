"""The decoding loop gives freed native memory back: buffers of ever-new sizes do not grow RSS without bound."""

import os
import subprocess
import sys

import pytest

from flashdraft import heap


FRAGMENT = """
import ctypes, torch
from flashdraft import heap
assert ctypes.CDLL("libc.so.6").mallopt(-3, 16 << 20)  # M_MMAP_THRESHOLD (at most 32 MiB): the buffers below
# come from the heap, whatever glibc's dynamic threshold would have been
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
base, keep = rss_mib(), []
for n in range(200, 1800, 8):  # 0.8-7 MB buffers
    x = torch.empty(n, 1024)
    x.fill_(1.0)
    keep.append(torch.empty(16))  # small live allocations between them pin the freed pieces
    del x
grown = rss_mib() - base
heap._last = float("-inf")
trimmed = heap.trim_heap() and not heap.trim_heap()  # trims, then not again within the period
print(grown, trimmed, rss_mib() - base)
"""


@pytest.mark.skipif(heap.MALLOC_TRIM is None or not sys.platform.startswith("linux"), reason="glibc only")
def test_trim_returns_fragmented_heap_to_the_os():
    """Buffers of slowly growing sizes (batch-shaped logits) leave glibc's heap fragmented; a trim gives it back. In a
    fresh process with glibc's own allocator and the mmap threshold pinned above the buffers: where its dynamic
    threshold stands depends on what the process freed before (in the suite, it made the test pass or fail by order)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
    out = subprocess.run([sys.executable, "-c", FRAGMENT], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    grown, trimmed, after = float(out[0]), out[1] == "True", float(out[2])
    assert grown > 64, grown  # the fragmentation is there (about 780 MiB here)
    assert trimmed
    assert after < grown / 4, (grown, after)


def test_the_decoding_loop_trims_as_it_goes(monkeypatch):
    from helpers import tiny_target

    from flashdraft.decoding import decode_batch, decoder

    calls = []
    monkeypatch.setattr(decoder, "trim_heap", lambda: calls.append(1))
    decode_batch(tiny_target("llama"), None, [[5, 6, 7], [8, 9]], max_new_tokens=6, stop_token_ids=())
    assert len(calls) >= 5  # once per cycle (it trims when its period has passed)
