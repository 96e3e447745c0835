"""Batched speculative decoding: N sequences share each cycle and each keeps its own accepted prefix (ragged).

A cycle: the policy picks each sequence's verify width (adaptive.py); sequences with a prompt-lookup draft take it,
the others share one batched drafter pass per block size (DFlash 1 or 2: chain, or a tree at T = 0; DLoop rows
draft alone); one target forward verifies every row's block at its own positions (target_batch.py); each row
accepts with its own rule, sampler and stop tokens and commits only its kept rows. Sequences join between cycles
(prefilled alone) and leave when done, so the batch is continuous. Width 1 everywhere is plain batched decoding
through the same loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from .. import target as T
from ..drafter import DFlashDrafter, draft_hidden_batch
from ..errors import FlashdraftError
from ..target_batch import BatchCache, forward_batch, supports_batch
from .adaptive import Acceptance, AdaptivePolicy, FixedPolicy, Row
from .loop import accept, pick, truncate
from .proposers import (LoopProposer, Proposal, chain_from_pass, graft, lookup_proposal, no_drafts,
                        tree_from_pass)
from .session import now
from .settings import PREFILL_CHUNK, DecodeSettings, settings_from
from .state import Cycle, DecodeState, GenerationResult, Timing


@dataclass
class RowState(DecodeState):
    """A sequence's DecodeState inside a batch: its target K/V is a row of the BatchCache."""

    position: int = 0  # committed positions (the row's length in the batch cache)

    @property
    def committed(self) -> int:
        return self.position


@dataclass(eq=False)
class Sequence:
    """One request in the batch."""

    key: object
    state: RowState
    settings: DecodeSettings  # resolved
    gen: torch.Generator  # the target's sampler
    draft_gen: torch.Generator  # the drafter's sampler (seed + 1, as Session)
    loop: LoopProposer | None = None  # DLoop rows draft alone
    room: int = 0
    stopped: bool = False
    error: Exception | None = None  # what this row raised in a cycle: it left the batch, the others went on
    output: list[int] = field(default_factory=list)
    cycles: list[Cycle] = field(default_factory=list)
    acceptance: Acceptance = field(default_factory=Acceptance)
    timing: Timing = field(default_factory=Timing)
    t0: float = field(default_factory=time.perf_counter)
    single: object = None  # while joining: the target cache its prompt is prefilled into, chunk by chunk
    prefilled: int = 0  # prompt tokens through the target so far

    @property
    def done(self) -> bool:
        return self.stopped or self.room <= 0 or self.error is not None

    def emit(self, new: list[int]) -> None:
        self.room -= len(new)
        self.output.extend(new)


class BatchDecoder:
    """Continuous batched decoding of one target (+ drafter); join() between cycles, step() runs one cycle."""

    def __init__(self, model: PreTrainedModel, drafter: DFlashDrafter | None, settings: DecodeSettings | None = None,
                 adaptive: bool = True, slots: int = 8, prefill_chunk: int = PREFILL_CHUNK):
        if not supports_batch(model):
            raise FlashdraftError("batched decoding needs a target whose layers all use full attention "
                                  "(a sliding-window cache cannot be kept per row); decode one request at a time")
        self.model, self.drafter, self.device = model, drafter, model.device
        self.settings = (settings or DecodeSettings()).validate()
        self.cache, self.active = BatchCache(model, slots), []  # slots: rows allocated up front (more grow it)
        self.joining: list[Sequence] = []  # prompts being prefilled, oldest first
        self.prefill_chunk = prefill_chunk
        self.layer_ids = list(drafter.config.target_layer_ids) if drafter is not None else []
        block = self.settings.resolve(drafter.config.block_size if drafter else None).block_size
        self.policy = AdaptivePolicy(max(block, 1 + (self.settings.tree or 0))) if adaptive else FixedPolicy()
        self.vocab = T.vocab_size(model)

    # ---------------------------------------------------------------- joining and leaving

    @torch.inference_mode()
    def join(self, prompt_ids: list[int], settings: DecodeSettings | None = None, key: object = None,
             **overrides) -> tuple[Sequence, Cycle]:
        """Take a new sequence → (the sequence, its first-token Cycle). A prompt of up to prefill_chunk tokens is
        prefilled now; a longer one chunk by chunk in the next step()s, whose results then carry its first token (its
        Cycle here is empty)."""
        d = self.drafter
        s = settings_from(settings or self.settings, **overrides).resolve(d.config.block_size if d else None)
        T.check_prompt(self.model, prompt_ids)
        room = min(s.max_new_tokens, T.context_limit(self.model) - len(prompt_ids))
        state = RowState(list(prompt_ids), len(prompt_ids), None, len(prompt_ids) + room)
        gen = torch.Generator(device=self.device).manual_seed(s.seed)
        seq = Sequence(key, state, s, gen, torch.Generator(device=self.device).manual_seed(s.seed + 1), room=room)
        if d is not None and s.block_size > 1 and s.loop_stages > 1:
            seq.loop = LoopProposer(self.model, d, s.sampling, seq.draft_gen, s.loop_stages, s.loop_gate)
        seq.single = T.new_cache(self.model)
        self.joining.append(seq)
        return seq, self.prefill(seq) if len(prompt_ids) <= self.prefill_chunk else Cycle([], 0, [])

    def prefill(self, seq: Sequence) -> Cycle | None:
        """The next chunk of seq's prompt through the target (alone, into its own cache); after the last one, its first
        token and its row in the batch → its first-token Cycle (None while chunks remain)."""
        st, s = seq.state, seq.settings
        a, b = seq.prefilled, min(seq.prefilled + self.prefill_chunk, st.num_prompt_tokens)
        t0 = now(self.device)
        out = T.forward(self.model, torch.tensor(st.tokens[a:b], device=self.device), a, seq.single, self.layer_ids,
                        logits_to_keep=1)
        if self.layer_ids:
            st.add_pending(out.features)
        seq.prefilled = b
        if b < st.num_prompt_tokens:
            seq.timing.prefill_s += now(self.device) - t0
            return None
        self.joining.remove(seq)
        first = pick(out.logits[-1], s.sampling, seq.gen)
        st.tokens.append(first)
        st.position = b
        seq.timing.prefill_s += now(self.device) - t0
        new, seq.stopped = truncate([first], set(s.stop_token_ids), seq.room)
        seq.emit(new)
        if not seq.done:  # a sequence done at its first token never takes a row
            self.cache.add_row(seq.single)
            self.active.append(seq)
        seq.single = None
        return Cycle([], 0, new)

    def drop(self, rows: list[int]) -> None:
        """Take these rows out of the cache and the batch (the cache refills holes from the end: follow its order)."""
        order = self.cache.remove_rows(rows)
        self.active = [self.active[i] for i in order]

    def leave(self, seq: Sequence) -> None:
        """Drop a sequence before it is done (a cancelled request)."""
        if seq in self.active:
            self.drop([self.active.index(seq)])
        if seq in self.joining:
            self.joining.remove(seq)

    @property
    def busy(self) -> bool:
        """Whether step() has work: rows to decode or prompts still being prefilled."""
        return bool(self.active or self.joining)

    # ---------------------------------------------------------------- one cycle

    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, Cycle]]:
        """One cycle for every active sequence; finished ones leave the batch (still reported here). A row that raises
        in its own part of the cycle (its draft choice, its acceptance) gets `error` set and leaves with an empty
        Cycle; the others go on. What fails in the shared passes (drafter, verify) raises."""
        rows = self.active
        if not rows:
            return self.prefill_next()
        widths = self.widths(rows)
        t1 = now(self.device)
        proposals, drafting = self.propose(rows, widths)
        failed = [(q, Cycle([], 0, [])) for q in rows if q.error is not None]
        if failed:  # out of the batch before the verify
            order = self.cache.remove_rows([i for i, q in enumerate(rows) if q.error is not None])
            proposals = [proposals[i] for i in order]
            rows = self.active = [rows[i] for i in order]
            if not rows:
                return failed + self.prefill_next()
        t2 = now(self.device)
        blocks = [[q.state.tokens[-1]] + p.drafts.tolist() for q, p in zip(rows, proposals)]
        outs = forward_batch(self.model, blocks, [p.parents for p in proposals], self.cache, self.layer_ids)
        t3 = now(self.device)
        results = [(q, self.guarded(q, self.commit, i, q, p, out, blocks[i]) or Cycle(blocks[i], 0, []))
                   for i, (q, p, out) in enumerate(zip(rows, proposals, outs))]
        self.policy.observe(len(rows), max(len(b) for b in blocks), now(self.device) - t2, drafting, t2 - t1)
        for q, _ in results:
            q.timing.draft_s += (t2 - t1) / len(rows)
            q.timing.verify_s += (t3 - t2) / len(rows)
        finished = [i for i, q in enumerate(rows) if q.done]
        if finished:
            self.drop(finished)
        return failed + results + self.prefill_next()  # a row that joins now decodes from the next cycle

    def prefill_next(self) -> list[tuple[Sequence, Cycle]]:
        """After a cycle, one prefill chunk of the longest-waiting joining prompt (so a long prompt stalls the batch for a
        chunk per cycle, not for its whole prefill) → its first-token Cycle once it has joined, or its error."""
        if not self.joining:
            return []
        seq = self.joining[0]
        cycle = self.guarded(seq, self.prefill, seq)
        if seq.error is not None:
            self.joining.remove(seq)
            return [(seq, Cycle([], 0, []))]
        return [(seq, cycle)] if cycle is not None else []

    @staticmethod
    def guarded(q: Sequence, fn, *args):
        """fn(*args) for row q; None with q.error set when it raises, so that one row's fault (NaN logits, a bug in
        its sampler) ends only that row."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - any fault of the row is reported on the row
            q.error = e
            return None

    def widths(self, rows: list[Sequence]) -> list[int]:
        """Each row's verify width this cycle: the policy's for greedy rows; a sampled row always verifies its whole
        block, because its random draws follow the widths and a seed must give what `generate` gives."""
        own = [self.max_width(q) for q in rows]
        spans = [min(q.settings.block_size, q.state.end - q.state.position) if self.trees(q) else None for q in rows]
        chosen = self.policy.choose([Row(q.acceptance, w, n) for q, w, n in zip(rows, own, spans)])
        return [c if q.settings.greedy else w for q, c, w in zip(rows, chosen, own)]

    def max_width(self, q: Sequence) -> int:
        """A row's widest useful verify: its block (or tree rows), capped by the positions it may still verify."""
        s, owed = q.settings, q.state.end - q.state.position
        if self.drafter is None or s.block_size <= 1 or owed <= 1:
            return 1
        if self.trees(q):  # a tree's rows are not one path: only its depth is capped by what is owed
            return max(s.block_size, 1 + s.tree)
        return min(s.block_size, owed)

    def trees(self, q: Sequence) -> bool:
        return bool(q.settings.tree) and q.settings.greedy and q.loop is None

    def propose(self, rows: list[Sequence], widths: list[int]) -> tuple[list[Proposal | None], int]:
        """Each row's proposal for its width; rows the drafter serves share batched passes → (proposals, rows
        drafted); None for a row whose own part raised (its `error` is set)."""
        proposals: list[Proposal | None] = [None] * len(rows)
        looks: list[Proposal | None] = [None] * len(rows)  # grafted onto trees after the drafter pass
        need: dict[int, list[int]] = {}  # drafter block size → rows
        for i, (q, w) in enumerate(zip(rows, widths)):
            st, start = q.state, q.state.position
            b = min(q.settings.block_size, st.end - start, 1 << 30 if self.trees(q) else w)
            if w <= 1 or b <= 1:
                proposals[i] = no_drafts(self.device)
                continue
            look = looks[i] = self.guarded(q, self.lookup, q, w) if q.settings.lookup else None
            if q.error is not None:
                continue
            if look is not None and not (q.settings.lookup == "tree" and self.trees(q)):
                proposals[i] = look
            elif q.loop is not None:
                proposals[i] = self.guarded(q, q.loop.propose, st, start, b)
            else:
                need.setdefault(max(b, 2), []).append(i)
        for b, idx in need.items():
            for i, p in zip(idx, self.drafter_pass([rows[i] for i in idx], b, [widths[i] for i in idx])):
                proposals[i] = graft(p, looks[i]) if looks[i] is not None and p is not None else p
        drafted = sum(len(v) for v in need.values()) + sum(q.loop is not None and widths[i] > 1
                                                            for i, q in enumerate(rows))
        return proposals, drafted

    def lookup(self, q: Sequence, width: int) -> Proposal | None:
        """q's prompt-lookup draft as Session makes it; for a greedy row under the adaptive policy at most width − 1
        deep (a sampled row drafts as `generate` does)."""
        st, start = q.state, q.state.position
        cap = width - 1 if isinstance(self.policy, AdaptivePolicy) and q.settings.greedy else None
        return lookup_proposal(st, start, min(q.settings.block_size, st.end - start), q.settings.greedy, self.vocab,
                               self.device, cap)

    def drafter_pass(self, rows: list[Sequence], b: int, widths: list[int]) -> list[Proposal]:
        """One drafter pass over [anchor, M × (b−1)] for every row → each row's chain, or tree at T = 0."""
        d = self.drafter
        embed, head = T.embed(self.model), T.lm_head(self.model)
        dtype = next(d.parameters()).dtype
        ids = torch.tensor([[q.state.tokens[-1]] + [d.config.mask_token_id] * (b - 1) for q in rows],
                           device=self.device)
        feats = [q.state.take_pending()[None] for q in rows]
        hidden = draft_hidden_batch(d, [q.state.draft_cache for q in rows], feats, embed(ids).to(dtype),
                                    [q.state.position for q in rows])
        logits = d.draft_logits(hidden, head)[:, 1:]  # [N, b-1, V]: the head over every row at once
        out = []
        for q, h, lg, w in zip(rows, hidden[:, 1:], logits, widths):
            anchor = q.state.tokens[-1]
            if self.trees(q):
                out.append(self.guarded(q, tree_from_pass, d, h, lg, anchor, min(q.settings.tree, w - 1)))
            else:
                out.append(self.guarded(q, chain_from_pass, d, h, lg, anchor, q.settings.sampling, q.draft_gen))
        return out

    def commit(self, row: int, q: Sequence, p: Proposal, out: T.TargetOutput, block: list[int]) -> Cycle:
        """Accept row's prefix with its own rule, keep its rows in the cache and queue its features."""
        kept, nxt = accept(p, out.logits, q.settings.sampling, q.gen)
        new, q.stopped = truncate(p.drafts[kept].tolist() + [nxt], set(q.settings.stop_token_ids), q.room)
        rows = ([0] + [i + 1 for i in kept])[: len(new)]
        start = q.state.position
        self.cache.keep(row, start, rows)
        q.state.position = start + len(rows)
        if self.layer_ids:
            q.state.add_pending(out.features[rows])
        q.state.tokens.extend(new)
        q.acceptance.observe(len(p.drafts) if p.parents is None else p.depth, len(kept))
        cycle = Cycle(block, len(kept), new, p.stages, p.lookup, p.parents)
        q.cycles.append(cycle)
        q.emit(new)
        return cycle

    def result(self, q: Sequence) -> GenerationResult:
        """The sequence's record, as Session.finish gives it (config: the settings it ran with)."""
        q.timing.close(time.perf_counter() - q.t0, len(q.output))
        config = q.settings.record(self.trees(q)) | {"adaptive": isinstance(self.policy, AdaptivePolicy)}
        return GenerationResult(q.output, q.state.num_prompt_tokens, q.cycles, q.timing, config)


def generate_batch(model: PreTrainedModel, drafter: DFlashDrafter | None, prompts: list[list[int]],
                   settings: DecodeSettings | list[DecodeSettings] | None = None, *, adaptive: bool = True,
                   max_batch: int | None = None, **overrides) -> list[GenerationResult]:
    """Decode several prompts together (continuous batching, at most max_batch at a time) → one result per prompt,
    in order. settings: one DecodeSettings for all, or one per prompt; keyword overrides apply to all."""
    per = settings if isinstance(settings, list) else [settings] * len(prompts)
    if len(per) != len(prompts):
        raise FlashdraftError(f"{len(per)} settings for {len(prompts)} prompts; give one, or one per prompt")
    if max_batch is not None and max_batch < 1:
        raise FlashdraftError(f"max_batch must be >= 1, got {max_batch}")
    dec = BatchDecoder(model, drafter, settings_from(per[0] if per else None, **overrides), adaptive,
                       slots=min(max_batch or len(prompts), len(prompts)) or 1)
    seqs, waiting = [], list(range(len(prompts)))
    while waiting or dec.busy:
        while waiting and (max_batch is None or len(dec.active) + len(dec.joining) < max_batch):
            i = waiting.pop(0)
            seqs.append(dec.join(prompts[i], settings_from(per[i], **overrides), key=i)[0])
        for q, _ in dec.step():
            if q.error is not None:  # every prompt was asked for: one that fails fails the call
                raise q.error
    return [dec.result(q) for q in sorted(seqs, key=lambda q: q.key)]
