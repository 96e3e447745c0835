"""The target's rules in a cycle (docs/design.md §1): its own next token, and which drafts it accepts.

The decoder (decoder.py) and MLX (mlx/decode.py) apply them: propose → verify → accept → commit.
"""

from __future__ import annotations

import torch
from ..sampling import accept_greedy, accept_sampling, process, sample
from ..sampling_params import SamplingParams
from ..tree import accept_tree_greedy
from .proposers import Proposal


def pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """The target's own next token from logits [V]: argmax, or a sample of the processed distribution."""
    return int(logits.argmax(-1)) if params.greedy else int(sample(process(logits, params), gen))


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
