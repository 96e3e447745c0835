"""The decoding loop gives freed native memory back: buffers of ever-new sizes do not grow RSS without bound."""

import sys

import pytest
import torch

from flashdraft import heap


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(heap.MALLOC_TRIM is None or not sys.platform.startswith("linux"), reason="glibc only")
def test_trim_returns_fragmented_heap_to_the_os():
    """Buffers of slowly growing sizes (batch-shaped logits) leave glibc's heap fragmented; a trim gives it back."""
    base = rss_mib()
    keep = []
    for _ in range(2):  # the second pass is below glibc's mmap threshold, which rose to the largest size freed
        for n in range(200, 1800, 8):  # 0.8–7 MB buffers
            x = torch.empty(n, 1024)
            x.fill_(1.0)
            keep.append(torch.empty(16))  # small live allocations between them pin the freed pieces
            del x
    grown = rss_mib() - base
    assert grown > 64, grown  # the fragmentation is there (about 780 MiB here)
    heap._last = float("-inf")
    assert heap.trim_heap() and not heap.trim_heap()  # trims, then not again within the period
    after = rss_mib() - base
    assert after < grown / 4, (grown, after)


def test_the_decoding_loop_trims_as_it_goes(monkeypatch):
    from helpers import tiny_target

    from flashdraft.decoding import decode_batch, decoder

    calls = []
    monkeypatch.setattr(decoder, "trim_heap", lambda: calls.append(1))
    decode_batch(tiny_target("llama"), None, [[5, 6, 7], [8, 9]], max_new_tokens=6, stop_token_ids=())
    assert len(calls) >= 5  # once per cycle (it trims when its period has passed)
