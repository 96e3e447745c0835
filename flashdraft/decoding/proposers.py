"""Proposals: what a cycle asks the target to verify, and the drafters that make them.

- The drafter's one pass (DFlash 1 or 2), batched over rows in decoder.py: a chain of b-1 drafts
  (chain_from_pass; DFlash 2's candidate-path walk sits in the drafter), or at T = 0 the `budget` likeliest nodes of
  its continuations, at most b-1 deep (tree_from_pass, tree.py).
- LoopProposer (DLoop): run the drafter for several stages per cycle while it is confident. Stage s runs the same
  drafter on an extended block at positions start .. start + s·(b−1): the anchor and all drafts of stages 1..s−1 as
  inputs (the target's embeddings of those tokens, exactly as the anchor is fed), followed by b−1 mask tokens. The
  drafter attends to its cached context (committed target features) and the whole extended block, so later stages
  condition on the unverified prefix: no new weights, the checkpoint format is unchanged; stage 1 is plain DFlash.
  After stage s the gate statistic Σ_k log q_k(d_k) over that stage's drafts decides: another stage runs only if
  s < S, the statistic > gate, and the longer block still ends before the generation's end.
- Prompt lookup: where the context's last n-gram recurs, the tokens that followed it (lookup.py) instead of — or,
  for a tree at temperature 0 (lookup="tree"), beside — the drafter's proposal.
- A custom proposer: any object with `propose(request, start, b) -> Proposal`, or a function (FunctionProposer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from transformers import PreTrainedModel

from .. import target as T
from ..drafter import ContextCache, DFlashDrafter, draft_hidden, proposal_logits
from ..lookup import LOOKUP_BLOCK, lookup_drafts, one_hot_q
from ..sampling_params import SamplingParams
from ..tree import TREE_WIDTH, best_first_tree, graft_chain, node_depths
from .settings import DecodeSettings
from .request import Request


@dataclass
class Proposal:
    """Drafts for one cycle: a chain, or a tree's nodes when `parents` is set."""

    drafts: torch.Tensor  # [k] token ids
    q: torch.Tensor | None = None  # [k, V]: what each chain draft was drawn from (None at T = 0)
    parents: list[int] | None = None  # tree: each node's parent among the drafts, -1 the anchor
    stages: int = 0  # drafting stages of b-1 drafts behind it (0: none, e.g. a lookup draft)
    lookup: bool = False  # prompt lookup supplied the drafts (or one path of the tree)

    @property
    def depth(self) -> int:
        """How far past the anchor the drafts reach."""
        return len(self.drafts) if self.parents is None else max(node_depths(self.parents), default=0)


class Proposer(Protocol):
    def propose(self, state: Request, start: int, b: int) -> Proposal: ...


def no_drafts(device: torch.device) -> Proposal:
    """A one-token block: the anchor alone (plain decoding)."""
    return Proposal(torch.zeros(0, dtype=torch.long, device=device))


# ---------------------------------------------------------------- the drafter

class DrafterPass:
    """pass(cache, new_features, inputs, start, n): one drafter pass over [inputs..., M x n] at positions start..
    → (final hidden states [len(inputs) + n, H], proposal logits [n, V] of the last n block positions)."""

    def __init__(self, model: PreTrainedModel, drafter: DFlashDrafter):
        self.drafter, self.embed, self.head = drafter, T.embed(model), T.lm_head(model)
        self.mask_id, self.device = drafter.config.mask_token_id, model.device
        self.dtype = next(drafter.parameters()).dtype

    def __call__(self, cache: ContextCache, new_features: torch.Tensor, inputs: list[int], start: int,
                 n: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = torch.tensor(inputs + [self.mask_id] * n, device=self.device)
        hidden = draft_hidden(self.drafter, cache, new_features, self.embed(block)[None].to(self.dtype), start)
        return hidden, proposal_logits(self.drafter, hidden, self.head, n)

    def stage(self, cache: ContextCache, new_features: torch.Tensor, inputs: list[int], start: int, n: int,
              params: SamplingParams, gen: torch.Generator | None):
        """n drafts after `inputs` → (drafts [n], q [n, V] or None, raw logits [n, V])."""
        hidden, logits = self(cache, new_features, inputs, start, n)
        drafts, q = self.drafter.choose_drafts(hidden[-n:], logits, inputs[-1], params, gen)
        return drafts, q, logits


def chain_from_pass(drafter: DFlashDrafter, hidden: torch.Tensor, logits: torch.Tensor, anchor: int,
                    params: SamplingParams, gen: torch.Generator | None) -> Proposal:
    """The drafter's chain from one pass: hidden [n, H] and logits [n, V] of the block's last n positions."""
    drafts, q = drafter.choose_drafts(hidden, logits, anchor, params, gen)
    return Proposal(drafts, q, stages=1)


def tree_from_pass(drafter: DFlashDrafter, hidden: torch.Tensor, logits: torch.Tensor, anchor: int, budget: int,
                   width: int = TREE_WIDTH) -> Proposal:
    """The `budget` likeliest nodes of the continuations one pass offers (tree.py), at most n = len(logits) deep."""
    children = drafter.tree_children(hidden, logits, width)
    tokens, parents = best_first_tree(children, anchor, logits.shape[0], budget)
    return Proposal(torch.tensor(tokens, dtype=torch.long, device=logits.device), parents=parents, stages=1)


def stage_confidence(drafts: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor) -> float:
    """Σ_k log q_k(d_k): q is the proposal the drafts were sampled from, or softmax(raw logits) at temperature 0."""
    k = torch.arange(drafts.shape[0], device=drafts.device)
    logq = q[k, drafts].log() if q is not None else torch.log_softmax(logits.float(), -1)[k, drafts]
    return float(logq.sum())


def fits(start: int, stages: int, n: int, end: int) -> bool:
    """Whether anchor + stages·n drafts at positions start.. stay before `end` (the generation's verify limit)."""
    return start + 1 + stages * n <= end


class LoopProposer:
    """DLoop: up to `stages` drafting stages of b-1 tokens per cycle, each continuing from the drafts before it."""

    def __init__(self, model: PreTrainedModel, drafter: DFlashDrafter, params: SamplingParams,
                 gen: torch.Generator | None, stages: int, gate: float):
        DecodeSettings(loop_stages=stages, loop_gate=gate).validate()
        self.run, self.params, self.gen = DrafterPass(model, drafter), params, gen
        self.stages, self.gate = stages, gate

    def propose(self, state: Request, start: int, b: int) -> Proposal:
        n = b - 1
        feats = state.take_pending()[None]  # committed features enter the drafter's cache once, in stage 1
        inputs, drafts, qs = [state.tokens[-1]], [], []
        for s in range(1, self.stages + 1):
            d, q, logits = self.run.stage(state.draft_cache, feats if s == 1 else feats[:, :0], inputs, start, n,
                                          self.params, self.gen)
            drafts.append(d)
            qs.append(q)
            # Lossless at T > 0: whether stage s+1 exists depends only on tokens already drafted (a stopping time
            # of the draft sequence), never on the target, and each draft keeps the q it was sampled from given
            # its prefix; verification of any position is therefore unchanged by how many positions follow it.
            if s == self.stages or not fits(start, s + 1, n, state.end) or not stage_confidence(d, q, logits) > self.gate:
                break
            inputs += d.tolist()
        return Proposal(torch.cat(drafts), None if qs[0] is None else torch.cat(qs), stages=len(drafts))


# ---------------------------------------------------------------- prompt lookup and custom proposers

def lookup_proposal(state: Request, start: int, b: int, greedy: bool, vocab: int, device: torch.device,
                    max_drafts: int | None = None) -> Proposal | None:
    """The tokens that followed the context's last recurring n-gram, or None. Deterministic: at T > 0 q is one-hot."""
    k = min(max(b, LOOKUP_BLOCK), state.end - start) - 1  # a lookup draft may run past a small drafter block
    k = k if max_drafts is None else min(k, max_drafts)
    look = lookup_drafts(state.tokens, k)
    if not look:
        return None
    drafts = torch.tensor(look, device=device)
    return Proposal(drafts, None if greedy else one_hot_q(drafts, vocab), lookup=True)


def graft(tree: Proposal, look: Proposal) -> Proposal:
    """The drafter's tree with the lookup draft as one more root path (sharing the nodes it already has)."""
    nodes, parents = graft_chain(tree.drafts.tolist(), tree.parents, look.drafts.tolist())
    return Proposal(torch.tensor(nodes, dtype=torch.long, device=tree.drafts.device), parents=parents,
                    stages=tree.stages, lookup=True)


class FunctionProposer:
    """A plain function fn(state, start, b) → Proposal, or → (drafts [k], q [k, V] or None) for a chain of whole
    stages of b-1 drafts (tests' oracles, custom drafters)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def propose(self, state: Request, start: int, b: int) -> Proposal:
        out = self.fn(state, start, b)
        if isinstance(out, Proposal):
            return out
        drafts, q = out
        return Proposal(drafts, q, stages=-(-len(drafts) // (b - 1)))


def as_proposer(propose) -> Proposer:
    """An object with .propose, or a function (see FunctionProposer)."""
    return propose if hasattr(propose, "propose") else FunctionProposer(propose)
