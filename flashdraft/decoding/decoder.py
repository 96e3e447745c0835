"""The torch decoding loop: N requests share each cycle and each keeps its own accepted prefix (ragged). `generate`
is a one-row batch of it with the fixed policy; `generate_batch` and the server run it with many.

A cycle: the policy picks each request's verify width (adaptive.py); requests with a prompt-lookup draft take it,
those with their own proposer (DLoop, a custom one) draft alone, the others share one drafter pass per block size
(DFlash 1 or 2: chain, or a tree at T = 0); one target forward verifies every row's block at its own positions
(target_batch.py); each row accepts with its own rule, sampler and stop tokens and commits only its kept rows.
Requests join between cycles (long prompts prefilled a chunk per cycle) and leave when done, so the batch is
continuous. Width 1 everywhere is plain decoding through the same loop.

A decoder with one slot, or over a target whose cache cannot be kept per row (sliding-window layers), decodes one
request at a time on that request's own cache (target.forward), exactly as the target decodes alone.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Iterator

import torch
from transformers import PreTrainedModel

from .. import lean, threads
from .. import target as T
from ..drafter import DFlashDrafter, draft_hidden, draft_hidden_batch, proposal_logits
from ..errors import FlashdraftError
from ..heap import trim_heap
from ..target_batch import BatchCache, forward_batch, supports_batch
from .adaptive import Acceptance, AdaptivePolicy, FixedPolicy, Row, pooled_acceptance
from .loop import accept, pick
from .prefixes import PrefixCache
from .proposers import (LoopProposer, Proposal, Proposer, as_proposer, chain_from_pass, graft, lookup_proposal,
                        no_drafts, tree_from_pass)
from .request import Cycle, GenerationResult, Request
from .settings import PREFILL_CHUNK, DecodeSettings, settings_from


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Decoder:
    """Continuous batched decoding of one target (+ drafter): join() between cycles, step() runs one cycle.

    slots: rows allocated up front (more grow them); 1, or a target whose layers do not all use full attention,
    means one request at a time on its own cache (`capacity` 1). prefill_chunk: prompt tokens prefilled per cycle
    (None: a whole prompt at join). layer_ids: target layers whose features are kept (default: the drafter's).
    prefixes: recent prompts' whole prefill chunks (prefixes.py, made for this prefill_chunk), so that a prompt
    extending one prefills only the rest; it may outlive the decoder.
    hook(request) runs after a request's prefill and after each of its cycles (tests check cache alignment).
    """

    def __init__(self, model: PreTrainedModel, drafter: DFlashDrafter | None, settings: DecodeSettings | None = None,
                 adaptive: bool = True, slots: int = 8, prefill_chunk: int | None = PREFILL_CHUNK,
                 layer_ids: list[int] | None = None, hook: Callable[[Request], None] | None = None,
                 prefixes: PrefixCache | None = None):
        self.model, self.drafter, self.device, self.hook = model, drafter, model.device, hook
        self.settings = (settings or DecodeSettings()).validate()
        self.ragged = supports_batch(model)  # every layer full attention: rows can share a ragged cache
        self.cache = BatchCache(model, slots) if self.ragged and slots > 1 else None  # None: one request, own cache
        self.capacity = None if self.cache is not None else 1
        self.active: list[Request] = []
        self.joining: list[Request] = []  # prompts being prefilled, oldest first
        self.prefill_chunk = prefill_chunk
        if prefixes is not None and prefixes.chunk != prefill_chunk:  # reuse is exact only at the same boundaries
            raise FlashdraftError(f"a prefix cache of {prefixes.chunk}-token chunks needs prefill_chunk={prefixes.chunk}")
        self.prefixes = prefixes
        self.layer_ids = list(layer_ids if layer_ids is not None else
                              drafter.config.target_layer_ids if drafter is not None else [])
        block = self.settings.resolve(drafter.config.block_size if drafter else None).block_size
        self.policy = AdaptivePolicy(max(block, 1 + (self.settings.tree or 0))) if adaptive else FixedPolicy()
        self.acceptance = pooled_acceptance()  # every request's cycles: the prior of the next request's
        log = os.environ.get("FLASHDRAFT_CYCLE_LOG")  # one JSON line a cycle (scripts/policy_regret.py reads it)
        self.cycle_log = open(log, "a", buffering=1) if log else None
        self.vocab = T.vocab_size(model)
        # threads.py: fewer threads while other processes hold cores, where that cannot change a rounding: the fused
        # float32 forward attends plain steps and verifies with the ragged kernel (torch's attention splits one query's
        # keys across threads) and its other ops give every output to one thread
        lm = lean.current(model)
        self.follow_load = self.device.type == "cpu" and lm is not None and lm.fused

    # ---------------------------------------------------------------- joining and leaving

    @torch.inference_mode()
    def join(self, prompt_ids: list[int], settings: DecodeSettings | None = None, key: object = None,
             propose: Proposer | Callable | None = None, **overrides) -> tuple[Request, Cycle]:
        """Take a new request → (the request, its first-token Cycle). A prompt of up to prefill_chunk tokens is
        prefilled now; a longer one chunk by chunk in the next step()s, whose results then carry its first token (its
        Cycle here is empty). propose: the request's own proposer (an object with .propose, or a function;
        proposers.py) instead of the drafter."""
        if self.capacity is not None and len(self.active) + len(self.joining) >= self.capacity:
            raise FlashdraftError(f"this decoder takes {self.capacity} request at a time; wait until one leaves")
        d, s = self.drafter, settings_from(settings or self.settings, **overrides)
        if s.loop_stages > 1 and propose is not None:
            raise FlashdraftError("loop_stages applies to the drafter's own proposer; drop it or loop inside `propose`")
        s = s.resolve(d.config.block_size if d else None, own_proposer=propose is None)
        if s.block_size > 1 and d is None and propose is None:
            raise FlashdraftError("block size > 1 needs a drafter; pass one or use block size 1")
        T.check_prompt(self.model, prompt_ids)
        q = Request.open(prompt_ids, s, T.context_limit(self.model), key, self.device)
        q.acceptance = Acceptance.seeded(self.acceptance)
        if propose is not None:
            q.proposer = as_proposer(propose)
        elif d is not None and s.block_size > 1 and s.loop_stages > 1:
            q.proposer = LoopProposer(self.model, d, s.sampling, q.draft_gen, s.loop_stages, s.loop_gate)
        # trees: asked for, greedy, from the drafter, on a cache that can compact a path
        q.trees = bool(s.tree) and s.greedy and s.block_size > 1 and q.proposer is None and d is not None \
            and self.ragged
        q.target_cache = T.new_cache(self.model)
        self.joining.append(q)
        if self.prefill_chunk is not None and len(prompt_ids) > self.prefill_chunk:
            return q, Cycle([], 0, [])
        try:
            return q, self.prefill(q)
        except BaseException:
            self.leave(q)
            raise

    def prefill(self, q: Request) -> Cycle | None:
        """The next chunk of q's prompt through the target (alone, into its own cache); after the last one, its first
        token and its row in the batch → its first-token Cycle (None while chunks remain)."""
        t0 = now(self.device)
        if q.prefilled == 0 and self.prefixes is not None:
            q.prefilled, feats = self.prefixes.restore(self.prompt(q), q.target_cache, self.keeps_features(q))
            if feats is not None:
                q.add_pending(feats)
        a = q.prefilled
        b = q.num_prompt_tokens if self.prefill_chunk is None else min(a + self.prefill_chunk, q.num_prompt_tokens)
        out = T.forward(self.model, torch.tensor(q.tokens[a:b], device=self.device), a, q.target_cache,
                        self.layer_ids, logits_to_keep=1)
        if self.layer_ids:
            q.add_pending(out.features)
        q.prefilled = b
        if b < q.num_prompt_tokens:
            q.timing.prefill_s += now(self.device) - t0
            return None
        self.joining.remove(q)
        if self.prefixes is not None:
            self.prefixes.add(self.prompt(q), q.target_cache, q.pending_features if self.keeps_features(q) else None)
        first = pick(out.logits[-1], q.settings.sampling, q.gen)
        q.position = b
        q.timing.prefill_s += now(self.device) - t0
        cycle = q.emit(Cycle([], 0, q.settle([first])))
        if not q.done:  # a request done at its first token never takes a row
            if self.cache is not None:
                self.cache.add_row(q.target_cache)
                q.target_cache = None
            self.active.append(q)
        if self.hook:
            self.hook(q)
        if q.done:
            q.target_cache = None
        return cycle

    @staticmethod
    def prompt(q: Request) -> torch.Tensor:
        """q's prompt ids [P]."""
        return torch.tensor(q.tokens[: q.num_prompt_tokens])

    def keeps_features(self, q: Request) -> bool:
        """Whether q keeps its prompt's features (Request.add_pending): it drafts, from these target layers."""
        return bool(self.layer_ids) and q.settings.block_size > 1

    def drop(self, rows: list[int]) -> None:
        """Take these rows out of the batch (a ragged cache refills holes from the end: follow its order)."""
        if self.cache is None:
            for i in rows:
                self.active[i].target_cache = None
            self.active = [q for i, q in enumerate(self.active) if i not in rows]
            return
        order = self.cache.remove_rows(rows)
        self.active = [self.active[i] for i in order]

    def leave(self, q: Request) -> None:
        """Drop a request before it is done (a cancelled request)."""
        if q in self.active:
            self.drop([self.active.index(q)])
        if q in self.joining:
            self.joining.remove(q)
            q.target_cache = None

    @property
    def busy(self) -> bool:
        """Whether step() has work: rows to decode or prompts still being prefilled."""
        return bool(self.active or self.joining)

    # ---------------------------------------------------------------- one cycle

    @torch.inference_mode()
    def step(self) -> list[tuple[Request, Cycle]]:
        """One cycle for every active request; finished ones leave the batch (still reported here). A row that raises
        in its own part of the cycle (its drafts, its acceptance) gets `error` set and leaves with an empty Cycle;
        the others go on. What fails in the shared passes (drafter, verify) raises."""
        trim_heap()  # freed batch-shaped buffers otherwise stay mapped in glibc's heap (heap.py)
        if self.follow_load:
            threads.follow()
        rows = self.active
        if not rows:
            return self.prefill_next()
        seen = [Row(q.acceptance, self.max_width(q), self.span(q)) for q in rows]  # what the policy knows of each
        widths = self.widths(rows, seen)
        t1 = now(self.device)
        proposals = self.propose(rows, widths)
        failed = [(q, Cycle([], 0, [])) for q in rows if q.error is not None]
        if failed:  # out of the batch before the verify
            self.drop([i for i, q in enumerate(rows) if q.error is not None])
            keep = [rows.index(q) for q in self.active]
            proposals, widths, seen = ([v[i] for i in keep] for v in (proposals, widths, seen))
            rows = self.active
            if not rows:
                return failed + self.prefill_next()
        t2 = now(self.device)
        blocks = [[q.tokens[-1]] + p.drafts.tolist() for q, p in zip(rows, proposals)]
        outs = self.verify(rows, blocks, [p.parents for p in proposals])
        t3 = now(self.device)
        if self.cycle_log is not None:  # before the acceptance moves
            expected = [r.expected_tokens(len(b)) for r, b in zip(seen, blocks)]
        results = [(q, self.guarded(q, self.commit, i, q, p, out, blocks[i]) or Cycle(blocks[i], 0, []))
                   for i, (q, p, out) in enumerate(zip(rows, proposals, outs))]
        t4, width = now(self.device), max(len(b) for b in blocks)
        emitted = [len(c.emitted) for _, c in results]
        # drafting is priced by the rows the plan let speculate: rows whose prompt lookup drafts skip the drafter,
        # and the plan cannot know which ahead, so the measured cost of D speculating rows carries their share
        self.policy.observe(len(rows), width, t4 - t2, sum(w > 1 for w in widths), t2 - t1)
        for q, r, b, n in zip(rows, seen, blocks, emitted):
            if len(b) > 1 and q.error is None:
                q.acceptance.observe_gain(r.chain_width(len(b)), n - 1)
        if self.cycle_log is not None:
            self.cycle_log.write(json.dumps({"rows": len(rows), "width": width, "widths": [len(b) for b in blocks],
                                             "draft_s": t2 - t1, "seconds": t4 - t1,
                                             "threads": torch.get_num_threads(), "expected": expected,
                                             "emitted": emitted, "tokens": sum(emitted)}) + "\n")
        for q, _ in results:
            q.timing.draft_s += (t2 - t1) / len(rows)
            q.timing.verify_s += (t3 - t2) / len(rows)
        finished = [i for i, q in enumerate(rows) if q.done]
        if finished:
            self.drop(finished)
        return failed + results + self.prefill_next()  # a row that joins now decodes from the next cycle

    def prefill_next(self) -> list[tuple[Request, Cycle]]:
        """After a cycle, one prefill chunk of the longest-waiting joining prompt (so a long prompt stalls the batch for a
        chunk per cycle, not for its whole prefill) → its first-token Cycle once it has joined, or its error."""
        if not self.joining:
            return []
        q = self.joining[0]
        cycle = self.guarded(q, self.prefill, q)
        if q.error is not None:
            self.leave(q)
            return [(q, Cycle([], 0, []))]
        return [(q, cycle)] if cycle is not None else []

    @staticmethod
    def guarded(q: Request, fn, *args):
        """fn(*args) for row q; None with q.error set when it raises, so that one row's fault (NaN logits, a bug in
        its sampler) ends only that row."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - any fault of the row is reported on the row
            q.error = e
            return None

    def widths(self, rows: list[Request], seen: list[Row]) -> list[int]:
        """Each row's verify width this cycle (seen: what the policy knows of each): the policy's for greedy rows; a
        sampled row always verifies its whole block, because its random draws follow the widths and a seed must give
        what `generate` gives."""
        chosen = self.policy.choose(seen)
        return [c if q.settings.greedy else r.max_width for q, c, r in zip(rows, chosen, seen)]

    @staticmethod
    def span(q: Request) -> int | None:
        """A tree-drafting row's span for the policy (its block, capped by what it is owed); None for a chain."""
        return min(q.settings.block_size, q.end - q.position) if q.trees else None

    def max_width(self, q: Request) -> int:
        """A row's widest useful verify: its block (or tree rows), capped by the positions it may still verify."""
        s, owed = q.settings, q.end - q.position
        if (self.drafter is None and q.proposer is None) or s.block_size <= 1 or owed <= 1:
            return 1
        if q.trees:  # a tree's rows are not one path: only its depth is capped by what is owed
            return max(s.block_size, 1 + s.tree)
        return min(s.block_size, owed)

    def propose(self, rows: list[Request], widths: list[int]) -> list[Proposal | None]:
        """Each row's proposal for its width; rows the drafter serves share batched passes; None for a row whose
        own part raised (its `error` is set)."""
        proposals: list[Proposal | None] = [None] * len(rows)
        looks: list[Proposal | None] = [None] * len(rows)  # grafted onto trees after the drafter pass
        need: dict[int, list[int]] = {}  # drafter block size → rows
        for i, (q, w) in enumerate(zip(rows, widths)):
            start = q.position
            b = min(q.settings.block_size, q.end - start, 1 << 30 if q.trees else w)
            if w <= 1 or b <= 1:
                proposals[i] = no_drafts(self.device)
                continue
            look = looks[i] = self.guarded(q, self.lookup, q, w) if q.settings.lookup else None
            if q.error is not None:
                continue
            if look is not None and not (q.settings.lookup == "tree" and q.trees):
                proposals[i] = look
            elif q.proposer is not None:
                proposals[i] = self.guarded(q, self.own_proposal, q, start, b)
            else:
                need.setdefault(max(b, 2), []).append(i)
        for b, idx in need.items():
            for i, p in zip(idx, self.drafter_pass([rows[i] for i in idx], b, [widths[i] for i in idx])):
                proposals[i] = graft(p, looks[i]) if looks[i] is not None and p is not None else p
        return proposals

    @staticmethod
    def own_proposal(q: Request, start: int, b: int) -> Proposal:
        """What q's own proposer drafts, checked against the positions q may still verify."""
        p = q.proposer.propose(q, start, b)
        if start + 1 + p.depth > q.end:
            raise RuntimeError(f"the proposer drafted {p.depth} tokens deep at {start}, past the end {q.end}")
        return p

    def lookup(self, q: Request, width: int) -> Proposal | None:
        """q's prompt-lookup draft; for a greedy row under the adaptive policy at most width − 1 deep (a sampled row
        drafts as `generate` does)."""
        start = q.position
        cap = width - 1 if isinstance(self.policy, AdaptivePolicy) and q.settings.greedy else None
        return lookup_proposal(q, start, min(q.settings.block_size, q.end - start), q.settings.greedy, self.vocab,
                               self.device, cap)

    def drafter_pass(self, rows: list[Request], b: int, widths: list[int]) -> list[Proposal]:
        """One drafter pass over [anchor, M × (b−1)] for every row → each row's chain, or tree at T = 0."""
        d = self.drafter
        embed, head = T.embed(self.model), T.lm_head(self.model)
        dtype = next(d.parameters()).dtype
        ids = torch.tensor([[q.tokens[-1]] + [d.config.mask_token_id] * (b - 1) for q in rows], device=self.device)
        feats = [q.take_pending()[None] for q in rows]
        if len(rows) == 1:  # one row attends to its own context: no padding, no mask over it
            hidden = draft_hidden(d, rows[0].draft_cache, feats[0], embed(ids).to(dtype), rows[0].position)
            hidden, logits = hidden[None, 1:], proposal_logits(d, hidden, head, b - 1)[None]
        else:
            hidden = draft_hidden_batch(d, [q.draft_cache for q in rows], feats, embed(ids).to(dtype),
                                        [q.position for q in rows])
            hidden, logits = hidden[:, 1:], d.draft_logits(hidden, head)[:, 1:]  # [N, b-1, V]: one head for all rows
        out = []
        for q, h, lg, w in zip(rows, hidden, logits, widths):
            anchor = q.tokens[-1]
            if q.trees:
                out.append(self.guarded(q, tree_from_pass, d, h, lg, anchor, min(q.settings.tree, w - 1)))
            else:
                out.append(self.guarded(q, chain_from_pass, d, h, lg, anchor, q.settings.sampling, q.draft_gen))
        return out

    def verify(self, rows: list[Request], blocks: list[list[int]],
               parents: list[list[int] | None]) -> list[T.TargetOutput]:
        """One target forward over every row's block at its own positions."""
        if self.cache is None:  # one request on its own cache
            q = rows[0]
            return [T.forward(self.model, torch.tensor(blocks[0], device=self.device), q.position, q.target_cache,
                              self.layer_ids, parents=parents[0])]
        return forward_batch(self.model, blocks, parents, self.cache, self.layer_ids)

    def commit(self, row: int, q: Request, p: Proposal, out: T.TargetOutput, block: list[int]) -> Cycle:
        """Accept row's prefix with its own rule, keep its rows in the cache and queue its features."""
        kept, nxt = accept(p, out.logits, q.settings.sampling, q.gen)
        new = q.settle(p.drafts[kept].tolist() + [nxt])
        rows = ([0] + [i + 1 for i in kept])[: len(new)]
        start = q.position
        if self.cache is None:
            T.keep_rows(q.target_cache, start, rows)
        else:
            self.cache.keep(row, start, rows)
        q.position = start + len(rows)
        if self.layer_ids:
            q.add_pending(out.features[rows])
        q.acceptance.observe(len(p.drafts) if p.parents is None else p.depth, len(kept))
        cycle = q.emit(Cycle(block, len(kept), new, p.stages, p.lookup, p.parents))
        if self.hook:
            self.hook(q)
        return cycle

    def result(self, q: Request) -> GenerationResult:
        """The request's record (config: the settings it ran with, and whether the policy was adaptive)."""
        return q.result(q.settings.record(q.trees) | {"adaptive": isinstance(self.policy, AdaptivePolicy)})


def generate_ids(model: PreTrainedModel, drafter: torch.nn.Module | None, prompt_ids: list[int],
                 settings: DecodeSettings | None = None, *, on_tokens: Callable[[list[int]], None] | None = None,
                 propose: Proposer | Callable | None = None, layer_ids: list[int] | None = None,
                 state_hook: Callable[[Request], None] | None = None, **overrides) -> GenerationResult:
    """Speculative decoding of prompt_ids with drafter (None, or block size 1: plain autoregressive decoding): a
    one-row Decoder with the fixed policy.

    settings: a DecodeSettings; keyword overrides use its field names (block_size, max_new_tokens, temperature, top_k,
    top_p, seed, stop_token_ids, lookup, tree, loop_stages, loop_gate). on_tokens(new ids) streams each cycle's tokens.
    propose: a custom proposer; layer_ids: the target layers whose features it reads; state_hook(request) runs after
    the prefill and after every cycle.
    """
    s = settings_from(settings, **overrides)
    dec = Decoder(model, drafter, s, adaptive=False, slots=1, prefill_chunk=None, layer_ids=layer_ids,
                  hook=state_hook)
    q, cycle = dec.join(prompt_ids, s, propose=propose)
    while True:
        if q.error is not None:
            raise q.error
        if on_tokens and cycle.emitted:
            on_tokens(cycle.emitted)
        if q.done:
            return q.result(q.settings.record(q.trees))
        (_, cycle), = dec.step()


def decode_stream(model: PreTrainedModel, drafter: DFlashDrafter | None, prompts: list[list[int]],
                  settings: DecodeSettings | list[DecodeSettings] | None = None, *, adaptive: bool = True,
                  max_batch: int | None = None, prefix_cache_mib: float = 0,
                  **overrides) -> Iterator[tuple[int, GenerationResult]]:
    """(prompt index, result) as each prompt finishes: continuous batching, at most max_batch at a time, prompts
    taken in list order. settings: one DecodeSettings for all, or one per prompt; keyword overrides apply to all.
    prefix_cache_mib: MiB of recent prompts' prefill chunks kept (prefixes.py): a prompt extending one prefills the rest."""
    per = settings if isinstance(settings, list) else [settings] * len(prompts)
    if len(per) != len(prompts):
        raise FlashdraftError(f"{len(per)} settings for {len(prompts)} prompts; give one, or one per prompt")
    if max_batch is not None and max_batch < 1:
        raise FlashdraftError(f"max_batch must be >= 1, got {max_batch}")
    dec = Decoder(model, drafter, settings_from(per[0] if per else None, **overrides), adaptive,
                  slots=min(max_batch or len(prompts), len(prompts)) or 1,
                  prefixes=PrefixCache.of_mib(PREFILL_CHUNK, prefix_cache_mib))
    limit = min(max_batch or len(prompts), dec.capacity or len(prompts))
    waiting = list(range(len(prompts)))[::-1]  # pop() takes the next
    while waiting or dec.busy:
        while waiting and len(dec.active) + len(dec.joining) < limit:
            i = waiting.pop()
            q, _ = dec.join(prompts[i], settings_from(per[i], **overrides), key=i)
            if q.done:  # done at its first token
                yield i, dec.result(q)
        for q, _ in dec.step():
            if q.error is not None:  # every prompt was asked for: one that fails fails the call
                raise q.error
            if q.done:
                yield q.key, dec.result(q)


def decode_batch(model: PreTrainedModel, drafter: DFlashDrafter | None, prompts: list[list[int]],
                 settings: DecodeSettings | list[DecodeSettings] | None = None, *, adaptive: bool = True,
                 max_batch: int | None = None, **overrides) -> list[GenerationResult]:
    """Decode several prompts together (decode_stream) → one result per prompt, in order."""
    done = dict(decode_stream(model, drafter, prompts, settings, adaptive=adaptive, max_batch=max_batch, **overrides))
    return [done[i] for i in range(len(prompts))]
