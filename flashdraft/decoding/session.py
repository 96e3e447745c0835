"""One generation as a session: setup (checks, caches, proposer) → prefill → step() per cycle → finish().

The Python API, the CLI, bench, serve and training's dev τ all drive this; nothing else sets up a generation.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch
from transformers import PreTrainedModel

from .. import target as T
from ..errors import FlashdraftError
from .loop import accept, commit, pick, truncate, verify
from .proposers import Proposer, make_proposer, no_drafts
from .settings import DecodeSettings, settings_from
from .state import Cycle, DecodeState, GenerationResult, Timing


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Session:
    """Decodes prompt_ids with drafter (None: plainly) under settings; the target's cache rolls back exactly.

    propose: a custom proposer (an object with .propose, or a function; proposers.py) instead of the drafter's.
    layer_ids: target layers whose features the drafter reads (default: the drafter's target_layer_ids).
    state_hook(state) runs after the prefill and after every cycle (tests check cache alignment with it).
    """

    def __init__(self, model: PreTrainedModel, drafter: torch.nn.Module | None, prompt_ids: list[int],
                 settings: DecodeSettings, *, propose: Proposer | Callable | None = None,
                 layer_ids: list[int] | None = None, state_hook: Callable[[DecodeState], None] | None = None):
        if settings.loop_stages > 1 and propose is not None:
            raise FlashdraftError("loop_stages applies to the drafter's own proposer; drop it or loop inside `propose`")
        s = settings.resolve(drafter.config.block_size if drafter is not None else None, own_proposer=propose is None)
        T.check_prompt(model, prompt_ids)
        if s.block_size > 1 and drafter is None and propose is None:
            raise FlashdraftError("block size > 1 needs a drafter; pass one or use block size 1")
        self.model, self.settings, self.params, self.state_hook = model, s, s.sampling, state_hook
        self.device = model.device
        room = min(s.max_new_tokens, T.context_limit(model) - len(prompt_ids))
        self.state = DecodeState(list(prompt_ids), len(prompt_ids), T.new_cache(model), len(prompt_ids) + room)
        self.room, self.stopped, self.stop_ids = room, False, set(s.stop_token_ids)
        speculative = s.block_size > 1 and (drafter is not None or propose is not None)
        self.trees = bool(s.tree) and speculative and propose is None and s.greedy and \
            T.supports_tree(self.state.target_cache)
        # the sampler of the target and of the drafter draw from their own streams, so a seed gives the same output
        self.gen = torch.Generator(device=self.device).manual_seed(s.seed)
        draft_gen = torch.Generator(device=self.device).manual_seed(s.seed + 1)
        self.proposer = make_proposer(model, drafter, s, draft_gen, self.trees, propose) if speculative else None
        if layer_ids is None:
            layer_ids = list(drafter.config.target_layer_ids) if drafter is not None and speculative else []
        self.layer_ids = layer_ids
        self.timing, self.cycles, self.output = Timing(), [], []
        self.t0 = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.stopped or self.room <= 0

    @torch.inference_mode()
    def prefill(self) -> Cycle:
        """The prompt's forward pass and the first new token (a Cycle with an empty block)."""
        st, t0 = self.state, now(self.device)
        out = T.forward(self.model, torch.tensor(st.tokens, device=self.device), 0, st.target_cache, self.layer_ids,
                        logits_to_keep=1)
        first = pick(out.logits[-1], self.params, self.gen)
        if self.layer_ids:
            st.add_pending(out.features)
        st.tokens.append(first)
        self.timing.prefill_s = now(self.device) - t0
        new, self.stopped = truncate([first], self.stop_ids, self.room)
        return self._emit(Cycle([], 0, new))

    @torch.inference_mode()
    def step(self) -> Cycle:
        """One cycle: propose → verify → accept → commit. At most the tokens still owed are verified (as the official
        loop: verify_size = min(block_size, max_length - start)), so the last blocks shrink."""
        st = self.state
        start, anchor = st.committed, st.tokens[-1]  # the anchor sits at position start, not yet in the cache
        b = min(self.settings.block_size, st.end - start)
        t1 = now(self.device)
        proposal = self.proposer.propose(st, start, b) if b > 1 and self.proposer else no_drafts(self.device)
        t2 = now(self.device)
        out = verify(self.model, st, proposal, start, self.layer_ids)
        t3 = now(self.device)
        kept, nxt = accept(proposal, out.logits, self.params, self.gen)
        new, self.stopped = truncate(proposal.drafts[kept].tolist() + [nxt], self.stop_ids, self.room)
        commit(st, start, kept, new, out, self.layer_ids)
        self.timing.draft_s += t2 - t1
        self.timing.verify_s += t3 - t2
        cycle = Cycle([anchor] + proposal.drafts.tolist(), len(kept), new, proposal.stages, proposal.lookup,
                      proposal.parents)
        self.cycles.append(cycle)
        return self._emit(cycle)

    def _emit(self, cycle: Cycle) -> Cycle:
        self.room -= len(cycle.emitted)
        self.output.extend(cycle.emitted)
        if self.state_hook:
            self.state_hook(self.state)
        return cycle

    def __iter__(self) -> Iterator[Cycle]:
        """The prefill's Cycle, then one per target verify until the generation ends."""
        yield self.prefill()
        while not self.done:
            yield self.step()

    def finish(self) -> GenerationResult:
        self.timing.close(time.perf_counter() - self.t0, len(self.output))
        return GenerationResult(self.output, self.state.num_prompt_tokens, self.cycles, self.timing,
                                self.settings.record(self.trees))


def generate_ids(model: PreTrainedModel, drafter: torch.nn.Module | None, prompt_ids: list[int],
                 settings: DecodeSettings | None = None, *, on_tokens: Callable[[list[int]], None] | None = None,
                 propose: Proposer | Callable | None = None, layer_ids: list[int] | None = None,
                 state_hook: Callable[[DecodeState], None] | None = None, **overrides) -> GenerationResult:
    """Speculative decoding of prompt_ids with drafter (None, or block size 1: plain autoregressive decoding).

    settings: a DecodeSettings; keyword overrides use its field names (block_size, max_new_tokens, temperature, top_k,
    top_p, seed, stop_token_ids, lookup, tree, loop_stages, loop_gate). on_tokens(new ids) streams each cycle's tokens.
    """
    session = Session(model, drafter, prompt_ids, settings_from(settings, **overrides), propose=propose,
                      layer_ids=layer_ids, state_hook=state_hook)
    for cycle in session:
        if on_tokens and cycle.emitted:
            on_tokens(cycle.emitted)
    return session.finish()
