"""Block loss (docs/design.md §4): decayed-weight CE on block positions 1..B-1, optional KL, accuracy and τ̂."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
# aux(hidden rows, their logits, row slice) -> (loss numerator, bool mask [m, B-1])
Aux = Callable[[torch.Tensor, torch.Tensor, slice], tuple[torch.Tensor, torch.Tensor]]


def default_gamma(block_size: int) -> float:
    """γ = 7 / 5 / 4 for B = 16 / 10 / 8 (DFlash); any other B: (B + 5) / 3, which matches 16 and 10."""
    return GAMMA.get(block_size, (block_size + 5) / 3)


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """w_k = exp(-(k - 1) / γ) for block positions k = 1..B-1; [B-1] float32."""
    g = default_gamma(block_size) if gamma is None else gamma
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / g)


def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_m Σ_k w_k CE(logits[m, k], labels[m, k]); logits [M, B-1, V], labels [M, B-1], w [B-1] → scalar."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    return (ce * w).sum()


def weighted_kl(logits: torch.Tensor, target_logits: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_m Σ_k w_k KL(p_target || q_drafter) over the vocabulary; both [M, B-1, V] → scalar."""
    logq = F.log_softmax(logits.float(), -1)
    logp = F.log_softmax(target_logits.float(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)  # [M, B-1]
    return (kl * w).sum()


def weighted_soft_ce(logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_m Σ_k w_k CE(p_k, q_k) with p the target's stored top-K renormalised: distillation without its full logits.

    logits [M, B-1, V] (indices into the softmax's vocabulary); ids [M, B-1, K] in the same indexing; logprobs
    [M, B-1, K] the target's log-probabilities of ids. Equals KL(p || q) up to p's entropy, a constant.
    """
    logq = F.log_softmax(logits.float(), -1).gather(-1, ids)
    p = torch.softmax(logprobs.float(), -1)
    return (-(p * logq).sum(-1) * w).sum()


def leading_correct(correct: torch.Tensor) -> torch.Tensor:
    """Per block, the number of leading correct drafts (what greedy verification would accept); [M, B-1] → [M]."""
    return correct.long().cumprod(-1).sum(-1)


def tau_hat(correct: torch.Tensor) -> float:
    """Expected acceptance length estimate: 1 + mean over blocks of leading correct positions."""
    return 1.0 + leading_correct(correct).float().mean().item() if len(correct) else float("nan")


def block_loss(hidden: torch.Tensor, labels: torch.Tensor, w: torch.Tensor,
               logits_fn: Callable[[torch.Tensor], torch.Tensor], target_logits: torch.Tensor | None = None,
               kl_weight: float = 0.0, chunk_rows: int = 4096, aux: Aux | None = None,
               soft: tuple[torch.Tensor, torch.Tensor] | None = None, soft_weight: float = 0.0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Loss numerator Σ w_k (CE_k + kl_weight · KL_k + soft_weight · softCE_k) [+ aux], correctness [M, B-1] and
    aux's mask, in row chunks.

    hidden: [M, B-1, h] drafter states of block positions 1..B-1; labels [M, B-1]; target_logits [M, B-1, V] or None;
    soft: the target's stored top-K (ids, log-probs), each [M, B-1, K], for weighted_soft_ce.
    aux(hidden, logits, rows) → (extra loss numerator, bool [m, B-1]) reuses each chunk's logits (DFlash 2 selector).
    Each chunk's logits are recomputed in backward (activation checkpointing) so [M, B-1, V] never lives at once.
    Divide the numerator by (number of blocks · Σ w) for the mean loss.
    """
    rows = max(1, chunk_rows // max(1, labels.shape[1]))

    def chunk(h: torch.Tensor, y: torch.Tensor, t: torch.Tensor | None, i: int):
        logits = logits_fn(h).float()  # one fp32 copy serves CE, KL and argmax (bf16 argmax is slow on CPU)
        num = weighted_ce(logits, y, w)
        if t is not None and kl_weight:
            num = num + kl_weight * weighted_kl(logits, t, w)
        if soft is not None and soft_weight:
            num = num + soft_weight * weighted_soft_ce(logits, soft[0][i:i + len(y)], soft[1][i:i + len(y)], w)
        extra = None
        if aux is not None:
            a_num, extra = aux(h, logits, slice(i, i + len(y)))
            num = num + a_num
        return num, logits.detach().argmax(-1) == y, extra

    total, correct, extras = hidden.new_zeros((), dtype=torch.float32), [], []
    for i in range(0, len(labels), rows):
        args = (hidden[i:i + rows], labels[i:i + rows], None if target_logits is None else target_logits[i:i + rows], i)
        if torch.is_grad_enabled() and hidden.requires_grad and len(labels) > rows:
            num, cor, extra = checkpoint(chunk, *args, use_reentrant=False)
        else:
            num, cor, extra = chunk(*args)
        total = total + num
        correct.append(cor)
        extras.append(extra)
    if not correct:
        return total, labels.new_zeros(labels.shape, dtype=torch.bool), None
    return total, torch.cat(correct), (torch.cat(extras) if aux is not None else None)


def loss_vocabulary(frequent: torch.Tensor, labels: torch.Tensor, n_random: int, vocab: int,
                    gen: torch.Generator) -> torch.Tensor:
    """Sorted token ids the softmax runs over: the frequent ids, this step's labels and n_random other ids.

    A sampled softmax: with a few thousand ids instead of the full vocabulary the LM-head GEMMs (the bulk of a CPU
    training step) shrink by the same factor; the random ids, redrawn every step, keep pushing down the logits of
    tokens the data never shows. Evaluation always uses the full vocabulary.
    """
    rand = torch.randint(0, vocab, (n_random,), generator=gen)
    return torch.unique(torch.cat([frequent.cpu(), labels.flatten().cpu(), rand]))


def remap_labels(labels: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Token ids → their index in the sorted vocab_ids (every label must be in it)."""
    return torch.searchsorted(vocab_ids, labels.contiguous())


def mean_loss(num: torch.Tensor, n_blocks: int, w: torch.Tensor) -> torch.Tensor:
    """Numerator → mean weighted loss per block (Σ w_k CE_k / Σ w_k averaged over blocks)."""
    return num / (max(n_blocks, 1) * float(w.sum()))


def position_accuracy(correct: torch.Tensor) -> torch.Tensor:
    """Mean correctness per block position k = 1..B-1; [M, B-1] → [B-1]."""
    return correct.float().mean(0) if len(correct) else torch.full((correct.shape[1],), math.nan)
