"""Prompt prefix reuse: the target K/V (and features) of recent prompts' whole prefill chunks.

A prompt that extends a recent one (a later turn of the same conversation) starts its prefill where their common
whole chunks end. Its cache is then bit for bit the one its own prefill would have made: prefill runs chunk by chunk
at fixed boundaries (`prefill_chunk`), and each reused chunk was computed from the same ids, positions and cache
before it. Only whole chunks are reused, and never the prompt's last token (its logits pick the first token).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..target import GrowingLayer


@dataclass
class Prefix:
    ids: torch.Tensor  # [m] int64: a prompt's first m tokens, m a multiple of the chunk
    keys: list[torch.Tensor]  # per layer [1, kv_heads, m, d]
    values: list[torch.Tensor]
    features: torch.Tensor | None  # [m, F] or None when the request kept none
    nbytes: int


def reusable(cache: DynamicCache | None) -> bool:
    """Only caches whose every layer is a full-attention GrowingLayer can be cut at a position and refilled."""
    return cache is not None and bool(cache.layers) and all(type(L) is GrowingLayer for L in cache.layers)


def common_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the common prefix of two 1-d id tensors."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0, 0]) if len(diff) else n


class PrefixCache:
    """Most recently used prompt prefixes, up to `budget` bytes; a prefix of a newer entry is dropped."""

    def __init__(self, chunk: int, budget: int):
        self.chunk, self.budget = chunk, budget  # prefill chunk (the decoder's), bytes
        self.entries: OrderedDict[int, Prefix] = OrderedDict()
        self.nbytes = 0
        self.serial = itertools.count()
        self.reused_tokens = 0  # prompt tokens not prefilled thanks to an entry, over the cache's life

    @classmethod
    def of_mib(cls, chunk: int, mib: float) -> PrefixCache | None:
        """A cache of `mib` MiB, or None for 0."""
        return cls(chunk, int(mib * 2**20)) if mib > 0 else None

    def usable(self, prompt: torch.Tensor, need_features: bool) -> tuple[Prefix | None, int]:
        """The entry sharing the most whole chunks with prompt [P] (leaving its last token) → (entry, tokens)."""
        best, most = None, 0
        for key, e in self.entries.items():
            if need_features and e.features is None:
                continue
            m = min(common_length(e.ids, prompt), len(prompt) - 1) // self.chunk * self.chunk
            if m > most:
                best, most = key, m
        if best is None:
            return None, 0
        self.entries.move_to_end(best)
        return self.entries[best], most

    def restore(self, prompt: torch.Tensor, cache: DynamicCache, need_features: bool
                ) -> tuple[int, torch.Tensor | None]:
        """Fill an empty cache with the longest usable prefix of prompt → (positions filled, their features or None)."""
        e, m = self.usable(prompt, need_features) if reusable(cache) and cache.get_seq_length() == 0 else (None, 0)
        if e is None:
            return 0, None
        for a in range(0, m, self.chunk):  # a chunk at a time: the buffers grow as that prefill's would
            for L, k, v in zip(cache.layers, e.keys, e.values):
                L.update(k[..., a:a + self.chunk, :], v[..., a:a + self.chunk, :])
        self.reused_tokens += m
        return m, e.features[:m] if e.features is not None else None

    def add(self, prompt: torch.Tensor, cache: DynamicCache, features: list[torch.Tensor] | None) -> None:
        """Keep the whole chunks of a prefilled prompt's cache (copied: the request goes on writing its own);
        features: its prompt's pieces [n_i, F], or None."""
        m = min(len(prompt), cache.get_seq_length()) // self.chunk * self.chunk if reusable(cache) else 0
        if m == 0:  # most prompts: shorter than a chunk, nothing joined or copied
            return
        features = torch.cat(features) if features else None
        views = [L.keys[..., :m, :] for L in cache.layers] + [L.values[..., :m, :] for L in cache.layers]
        feats = features[:m] if features is not None and len(features) >= m else None
        nbytes = sum(t.numel() * t.element_size() for t in views + ([feats] if feats is not None else []))
        if nbytes > self.budget:
            return
        ids = prompt[:m].clone()
        for key in [k for k, e in self.entries.items() if len(e.ids) <= m and torch.equal(e.ids, ids[:len(e.ids)])
                    and (feats is not None or e.features is None)]:
            self.drop(key)  # what it holds, this entry holds too
        while self.nbytes + nbytes > self.budget:
            self.drop(next(iter(self.entries)))
        n, kv = len(cache.layers), [t.clone() for t in views]
        self.entries[next(self.serial)] = Prefix(ids, kv[:n], kv[n:], None if feats is None else feats.clone(), nbytes)
        self.nbytes += nbytes

    def drop(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes
