"""One generation on MLX: prefill, then cycles of draft → verify (one lazy graph, one evaluation) → accept →
commit.

The rules and the bookkeeping are the torch engine's: acceptance is sampling.py's accept_greedy / accept_sampling,
the first token is decoding/loop.py's pick, and a decoding/request.py Request keeps tokens, room, stops, samplers,
output, cycles and timing and turns into the GenerationResult. Arrays cross to the host once per
cycle, after the verify: the drafts and the target's argmax ids (greedy), or the drafts, q and the verify logits
(sampling). Prompt lookup drafts as in the torch engine; draft trees and DLoop stages are torch-only.
"""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx
import numpy as np
import torch

from ..decoding import Cycle, DecodeSettings, GenerationResult, Request
from ..decoding.loop import pick
from ..lookup import LOOKUP_BLOCK, lookup_drafts, one_hot_q
from ..sampling import accept_greedy, accept_sampling, process
from .drafter import MlxContextCache, MlxDrafter, draft
from .target import MlxTarget, cache_length, trim


def to_torch(a: mx.array) -> torch.Tensor:
    """An evaluated MLX array on the host as a torch tensor (float32 for floating arrays)."""
    if mx.issubdtype(a.dtype, mx.floating):
        a = a.astype(mx.float32)
    return torch.from_numpy(np.array(a, copy=True))


class MlxSession:
    """Decodes prompt_ids on target with drafter (None: plainly) under resolved settings (tree 0, loop_stages 1)."""

    def __init__(self, target: MlxTarget, drafter: MlxDrafter | None, prompt_ids: list[int], settings: DecodeSettings,
                 vocab: int, context: int, split_timing: bool = False):
        s = settings
        self.split_timing = split_timing  # evaluate the drafts on their own to time drafting apart (the cost profile)
        self.target, self.drafter, self.settings, self.params = target, drafter, s, s.sampling
        self.vocab = vocab
        self.request = q = Request.open(prompt_ids, s, context)  # its torch samplers: the target's is shared
        self.tokens, self.end, self.timing = q.tokens, q.end, q.timing
        self.cache, self.draft_cache = target.new_cache(), MlxContextCache()
        self.speculative = s.block_size > 1 and drafter is not None
        self.lookup = bool(s.lookup) and s.block_size > 1
        self.layer_ids = list(drafter.config.target_layer_ids) if self.speculative else []
        self.pending: mx.array | None = None  # features of committed positions not yet in the drafter's cache
        self.key = mx.random.key(s.seed + 1)  # the drafter's sampler (MLX), apart from the target's (torch)

    @property
    def done(self) -> bool:
        return self.request.done

    def _add_pending(self, feats: mx.array | None) -> None:
        if feats is not None:
            self.pending = feats if self.pending is None else mx.concatenate([self.pending, feats], 0)

    def prefill(self) -> Cycle:
        t0 = time.perf_counter()
        logits, feats = self.target.forward(self.tokens, self.cache, self.layer_ids, keep=1)
        mx.eval(logits, *(() if feats is None else (feats,)))
        first = pick(to_torch(logits[-1]), self.params, self.request.gen)
        self._add_pending(feats)
        self.timing.prefill_s = time.perf_counter() - t0
        return self.request.emit(Cycle([], 0, self.request.settle([first])))

    def _propose(self, start: int, b: int) -> tuple[mx.array, mx.array | None, int, bool]:
        """(drafts [k], q [k, V] or None, drafting stages, from prompt lookup), lazily."""
        if self.lookup:
            look = lookup_drafts(self.tokens, min(max(b, LOOKUP_BLOCK), self.end - start) - 1)
            if look:
                q = None if self.params.greedy else one_hot_q(torch.tensor(look), self.vocab)
                return mx.array(look), q, 0, True
        if b <= 1 or not self.speculative:
            return mx.array([], dtype=mx.int32), None, 0, False
        n = b - 1
        block = mx.array([self.tokens[-1]] + [self.drafter.config.mask_token_id] * n)
        emb = self.target.embed(block)[None].astype(self.drafter.fc.weight.dtype)
        feats, self.pending = self.pending, None
        hidden, logits = draft(self.drafter, self.draft_cache, feats, emb, start, self.target.head_weight(), n)
        key = None
        if not self.params.greedy:
            self.key, key = mx.random.split(self.key)
        drafts, q = self.drafter.choose_drafts(hidden, logits, self.tokens[-1], self.params, key)
        return drafts, q, 1, False

    def step(self) -> Cycle:
        """One cycle; the last blocks shrink to the tokens still owed (as the torch engine)."""
        start, anchor = cache_length(self.cache), self.tokens[-1]
        b = min(self.settings.block_size, self.end - start)
        t0 = time.perf_counter()
        drafts, q, stages, looked = self._propose(start, b)
        if self.split_timing:
            mx.eval(drafts, *(() if q is None or isinstance(q, torch.Tensor) else (q,)))
            self.timing.draft_s += time.perf_counter() - t0
            t0 = time.perf_counter()
        block = mx.concatenate([mx.array([anchor]), drafts.astype(mx.int32)])
        logits, feats = self.target.forward(block, self.cache, self.layer_ids)
        extra = () if feats is None else (feats,)
        if self.params.greedy:
            ids = mx.argmax(logits, -1)
            mx.eval(drafts, ids, *extra)
            n, nxt = accept_greedy(to_torch(drafts).long(), to_torch(ids).long())
        else:
            mx.eval(drafts, logits, *extra, *(() if q is None or isinstance(q, torch.Tensor) else (q,)))
            d = to_torch(drafts).long()
            q_t = q if isinstance(q, torch.Tensor) else to_torch(q) if q is not None else torch.zeros(0, self.vocab)
            n, nxt = accept_sampling(d, q_t, process(to_torch(logits), self.params), self.request.gen)
        drafted = np.array(drafts).tolist()
        new = self.request.settle(drafted[:n] + [nxt])
        trim(self.cache, len(drafted) + 1 - len(new))  # keep the anchor and the emitted drafts' rows
        if self.layer_ids:
            self._add_pending(feats[: len(new)])
        self.timing.verify_s += time.perf_counter() - t0  # with the draft, unless split_timing: one graph
        return self.request.emit(Cycle([anchor] + drafted, n, new, stages, looked))

    def finish(self) -> GenerationResult:
        return self.request.result(self.settings.record(False))


def mlx_generate_ids(target: MlxTarget, drafter: MlxDrafter | None, prompt_ids: list[int], settings: DecodeSettings,
               vocab: int, context: int, on_tokens: Callable[[list[int]], None] | None = None,
               split_timing: bool = False) -> GenerationResult:
    """Speculative decoding of prompt_ids on MLX with resolved settings (drafter None or block size 1: plainly);
    split_timing evaluates each draft before its verify, so timing.draft_s is drafting alone (one more sync)."""
    session = MlxSession(target, drafter, prompt_ids, settings, vocab, context, split_timing)
    cycle = session.prefill()
    while True:
        if on_tokens and cycle.emitted:
            on_tokens(cycle.emitted)
        if session.done:
            return session.finish()
        cycle = session.step()
