"""Continuous batching for `prepare`: finished rows are replaced by new prompts, K/V live in preallocated slots.

Why not `model.generate`: a static batch pads every row to its longest prompt and keeps finished rows until the
longest answer ends, and HF's DynamicCache re-concatenates the whole cache at every step (half a CPU decode step
at batch 64). Here all rows share one column pointer `hi` (rows are left-aligned to it, like left padding), each
row remembers its first valid column, and a decode step writes one column into a preallocated buffer.

Along the way each row collects what offline training needs: the selected-layer features of every position and the
target's top-k log-probabilities of the distribution that produced every generated token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from ..target import cache_kwarg

PREFILL_TOKENS = 8192  # padded prompt tokens per prefill forward: long prompts are not padded up together with many


class SlotLayer(DynamicLayer):
    """A cache layer over a preallocated [R, H, W, D] buffer; a forward sees rows [:n] and columns [lo:hi]."""

    def __init__(self, rows: int, width: int):
        super().__init__()
        self.rows, self.width, self.n, self.lo, self.hi = rows, width, 0, 0, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        shape = (self.rows, key_states.shape[1], self.width, key_states.shape[-1])
        self.device = key_states.device
        self.keys = key_states.new_zeros(shape)
        self.values = value_states.new_zeros(shape)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k = key_states.shape[-2]
        self.keys[: self.n, :, self.hi:self.hi + k] = key_states
        self.values[: self.n, :, self.hi:self.hi + k] = value_states
        self.hi += k
        return self.keys[: self.n, :, self.lo:self.hi], self.values[: self.n, :, self.lo:self.hi]

    def get_seq_length(self) -> int:
        return self.hi - self.lo

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.hi - self.lo + query_length, 0


@dataclass
class PromptRow:
    """One prompt being answered: its ids so far, features per fed position, top-k per generated token."""

    index: int  # position in the caller's prompt list
    prompt_len: int
    ids: list[int]
    start: int = 0  # first valid cache column
    features: list[torch.Tensor] = field(default_factory=list)  # [n_i, F] chunks, one per fed position range
    topk_ids: list[torch.Tensor] = field(default_factory=list)  # [k] per generated token
    topk_logprobs: list[torch.Tensor] = field(default_factory=list)
    fed: int = 0  # positions whose features are collected
    finished: bool = False  # ended with a stop token
    done: bool = False  # no more tokens; fed once more only to get the last position's features


@dataclass
class Answer:
    """A finished row: prompt + response ids, features [n, F], top-k [n_resp, k] (None when not asked for)."""

    index: int
    ids: list[int]
    prompt_len: int
    finished: bool
    features: torch.Tensor | None
    topk_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None


def next_tokens(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    """Next tokens [b] from logits [b, V]: argmax at temperature 0, else a draw from softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=gen)[:, 0]


class Batcher:
    """Greedy or sampled answers for many prompts with at most `rows` in flight."""

    def __init__(self, model, *, rows: int, max_prompt: int, max_new_tokens: int, stop_ids: list[int],
                 pad_id: int, temperature: float = 0.0, seed: int = 0, layer_ids: list[int] | None = None,
                 topk: int = 0):
        self.model, self.rows, self.max_new = model, rows, max_new_tokens
        self.max_prompt = max_prompt
        self.stop, self.pad, self.temperature = set(stop_ids), pad_id, temperature
        self.layer_ids, self.topk = layer_ids or [], topk
        self.gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
        n_layers = model.config.get_text_config().num_hidden_layers
        # A live row spans at most max_prompt + max_new_tokens columns, so when the pointer reaches the end a
        # compaction frees at least `slack` columns: one buffer copy per `slack` steps.
        slack = max(64, max_new_tokens)
        self.width = max_prompt + max_new_tokens + slack + 1
        self.layers = [SlotLayer(rows, self.width) for _ in range(n_layers)]
        self.cache = Cache(layers=self.layers)
        self.live: list[PromptRow] = []
        self.hi = max_prompt  # a new prompt of any allowed length fits left of the pointer
        self.dev = next(model.parameters()).device

    # ------------------------------------------------------------ cache bookkeeping

    def set_window(self) -> None:
        lo = min((r.start for r in self.live), default=self.hi)
        for L in self.layers:
            L.n, L.lo, L.hi = len(self.live), lo, self.hi

    def compact(self) -> None:
        """Shift every row's columns left so the pointer has room again."""
        shift = min(min((r.start for r in self.live), default=self.hi), self.hi - self.max_prompt)
        if shift <= 0:
            return
        for L in self.layers:
            if L.is_initialized:
                L.keys[:, :, : self.hi - shift] = L.keys[:, :, shift:self.hi].clone()
                L.values[:, :, : self.hi - shift] = L.values[:, :, shift:self.hi].clone()
        for r in self.live:
            r.start -= shift
        self.hi -= shift

    def drop(self, i: int) -> None:
        """Remove live row i by moving the last row into its slot."""
        last = len(self.live) - 1
        if i != last:
            for L in self.layers:
                if L.is_initialized:
                    L.keys[i] = L.keys[last]
                    L.values[i] = L.values[last]
            self.live[i] = self.live[last]
        self.live.pop()

    # ------------------------------------------------------------ model calls

    def features_of(self, hidden_states) -> torch.Tensor | None:
        if not self.layer_ids:
            return None
        return torch.cat([hidden_states[i + 1] for i in self.layer_ids], -1).to(torch.bfloat16)

    def record(self, rows: list[PromptRow], logits: torch.Tensor) -> None:
        """Append the next token (and its top-k) to each of rows from their logits [b, V]."""
        nxt = next_tokens(logits, self.temperature, self.gen).tolist()
        if self.topk:
            lp = torch.log_softmax(logits.float(), -1)
            vals, idx = lp.topk(self.topk, -1)
        for j, r in enumerate(rows):
            r.ids.append(nxt[j])
            if self.topk:
                r.topk_ids.append(idx[j].to(torch.int32))
                r.topk_logprobs.append(vals[j].clamp_min(-60).to(torch.float16))
            if nxt[j] in self.stop or len(r.ids) - r.prompt_len >= self.max_new:
                r.finished, r.done = nxt[j] in self.stop, True

    def admit(self, new: list[PromptRow]) -> None:
        """Prefill new rows (left-padded together) and place their K/V so each prompt ends at the pointer."""
        if self.hi + 1 > self.width:
            self.compact()
        P = max(r.prompt_len for r in new)
        ids = torch.full((len(new), P), self.pad, dtype=torch.long)
        mask = torch.zeros((len(new), P), dtype=torch.long)
        for j, r in enumerate(new):
            ids[j, P - r.prompt_len:] = torch.tensor(r.ids)
            mask[j, P - r.prompt_len:] = 1
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids.to(self.dev), attention_mask=mask.to(self.dev), position_ids=pos.to(self.dev),
                         use_cache=True, logits_to_keep=1, output_hidden_states=bool(self.layer_ids),
                         **{cache_kwarg(self.model): cache})
        feats = self.features_of(out.hidden_states) if self.layer_ids else None
        n0 = len(self.live)
        for j, r in enumerate(new):
            r.start = self.hi - r.prompt_len
            for L, C in zip(self.layers, cache.layers):
                if not L.is_initialized:
                    L.lazy_initialization(C.keys, C.values)
                L.keys[n0 + j, :, r.start:self.hi] = C.keys[j, :, P - r.prompt_len:]
                L.values[n0 + j, :, r.start:self.hi] = C.values[j, :, P - r.prompt_len:]
            if feats is not None:
                r.features.append(feats[j, P - r.prompt_len:].cpu())
            r.fed = r.prompt_len
        self.record(new, out.logits[:, -1])
        self.live.extend(new)

    def step(self) -> None:
        """Feed every live row its last token at the pointer column."""
        if self.hi + 1 > self.width:
            self.compact()
        self.set_window()
        lo = self.layers[0].lo
        cols = torch.arange(lo, self.hi + 1)
        mask = (cols[None] >= torch.tensor([r.start for r in self.live])[:, None]).long()
        ids = torch.tensor([[r.ids[-1]] for r in self.live])
        pos = torch.tensor([[self.hi - r.start] for r in self.live])
        out = self.model(input_ids=ids.to(self.dev), attention_mask=mask.to(self.dev), position_ids=pos.to(self.dev),
                         use_cache=True, output_hidden_states=bool(self.layer_ids),
                         **{cache_kwarg(self.model): self.cache})
        self.hi += 1
        feats = self.features_of(out.hidden_states)
        going = [j for j, r in enumerate(self.live) if not r.done]
        for j, r in enumerate(self.live):
            r.fed += 1
            if feats is not None:
                r.features.append(feats[j].cpu())
        self.record([self.live[j] for j in going], out.logits[going, -1])

    def answer(self, r: PromptRow) -> Answer:
        cat = lambda xs, dim=0: torch.cat(xs, dim) if xs else None  # noqa: E731
        stack = lambda xs: torch.stack(xs) if xs else None  # noqa: E731
        return Answer(r.index, r.ids, r.prompt_len, r.finished, cat(r.features),
                      stack(r.topk_ids), stack(r.topk_logprobs))

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], admit_at: int | None = None,
            order: list[int] | None = None) -> Iterator[Answer]:
        """Answers for prompts in completion order, admitted in `order` (default: shortest first); refills when
        `admit_at` slots are free."""
        too_long = [len(p) for p in prompts if len(p) > self.max_prompt or not p]
        if too_long:
            raise ValueError(f"prompt lengths {too_long[:3]} outside 1..{self.max_prompt}")
        admit_at = admit_at or max(1, self.rows // 4)
        order = order if order is not None else sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        queue = list(order)[::-1]  # pop() gives the next to admit
        while queue or self.live:
            free = self.rows - len(self.live)
            if queue and (free >= admit_at or not self.live):
                take = [queue.pop() for _ in range(min(free, len(queue)))]
                for group in prefill_groups([len(prompts[i]) for i in take]):
                    self.admit([PromptRow(take[k], len(prompts[take[k]]), list(prompts[take[k]])) for k in group])
            else:
                self.step()
            # A done row leaves once it has been fed its last token (features for every position), or at once
            # when no features are wanted.
            for i in reversed(range(len(self.live))):
                r = self.live[i]
                if r.done and (not self.layer_ids or r.fed == len(r.ids)):
                    self.drop(i)
                    yield self.answer(r)


def prefill_groups(lengths: list[int], budget: int | None = None) -> list[list[int]]:
    """Consecutive runs of prompts whose left-padded prefill stays within `budget` (PREFILL_TOKENS) tokens, one prompt
    at least: admitted prompts come shortest first, so a few long ones no longer pad dozens of short ones."""
    budget = budget or PREFILL_TOKENS
    groups: list[list[int]] = []
    top = 0
    for k, n in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * max(top, n) <= budget:
            groups[-1].append(k)
            top = max(top, n)
        else:
            groups.append([k])
            top = n
    return groups
