"""The parts of one cycle (docs/design.md §1): verify the proposal, accept a prefix, commit it or roll back.

Session.step (session.py) strings them together: propose → verify → accept → commit.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .. import target as T
from ..sampling import SamplingParams, accept_greedy, accept_sampling, process, sample
from ..tree import accept_tree_greedy
from .proposers import Proposal
from .state import DecodeState


def pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """The target's own next token from logits [V]: argmax, or a sample of the processed distribution."""
    return int(logits.argmax(-1)) if params.greedy else int(sample(process(logits, params), gen))


def verify(model: PreTrainedModel, state: DecodeState, p: Proposal, start: int,
           layer_ids: list[int]) -> T.TargetOutput:
    """One target forward over [anchor, drafts...] at positions start..: logits [1 + k, V] and the features."""
    if start + 1 + p.depth > state.end:
        raise RuntimeError(f"the proposer drafted {p.depth} tokens deep at {start}, past the end {state.end}")
    block = torch.cat([torch.tensor([state.tokens[-1]], device=p.drafts.device), p.drafts])
    return T.forward(model, block, start, state.target_cache, layer_ids, parents=p.parents)


def accept(p: Proposal, logits: torch.Tensor, params: SamplingParams,
           gen: torch.Generator) -> tuple[list[int], int]:
    """→ (indices of the kept drafts, root to leaf; the target's next token). Trees are greedy only; chains use the
    greedy rule at T = 0, else speculative sampling with the q the drafts were drawn from."""
    if p.parents is not None:
        return accept_tree_greedy(p.drafts.tolist(), p.parents, logits.argmax(-1).tolist())
    if params.greedy:
        n, nxt = accept_greedy(p.drafts, logits.argmax(-1))
    else:
        if p.q is None and len(p.drafts):
            raise RuntimeError("a proposer must return the q its drafts were sampled from at temperature > 0")
        q = p.q if p.q is not None else logits[:0]
        n, nxt = accept_sampling(p.drafts, q, process(logits, params), gen)
    return list(range(n)), nxt


def truncate(new: list[int], stop_ids: set[int], room: int) -> tuple[list[int], bool]:
    """Cut after the first stop token and to the room left; returns (tokens, hit a stop token)."""
    for i, t in enumerate(new[:room]):
        if t in stop_ids:
            return new[: i + 1], True
    return new[:room], False


def commit(state: DecodeState, start: int, kept: list[int], new: list[int], out: T.TargetOutput,
           layer_ids: list[int]) -> None:
    """Keep the anchor and the emitted drafts' rows in the target cache (dropping the rest), queue their features
    for the drafter, and append the emitted tokens; the last one is the next anchor."""
    rows = ([0] + [i + 1 for i in kept])[: len(new)]
    T.keep_rows(state.target_cache, start, rows)
    if layer_ids:
        state.add_pending(out.features[rows])
    state.tokens.extend(new)
