"""DFlash 2 additions (docs/design.md §3): grouped dynamic short convolutions and the candidate-path selector."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import DrafterConfig


def grouped_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, block_size: int) -> torch.Tensor:
    """out_t = Σ_o (base[o, c] + δ_t[o, c // G]) · x_{t-o, c}, never reaching across a block start.

    x: [b, T, H] with T = n_blocks * block_size; base: [K, H]; delta: [b, T, K, H/G].
    """
    b, T, H = x.shape
    K, groups = base.shape[0], delta.shape[-1]
    xb = x.view(b, T // block_size, block_size, H)
    out = torch.zeros_like(x)
    for o in range(K):
        shifted = F.pad(xb, (0, 0, o, 0))[:, :, :block_size].reshape(b, T, H)  # position t sees t - o (zeros before the block)
        w = base[o] + delta[:, :, o].repeat_interleave(H // groups, -1)  # [b, T, H]
        out = out + w * shifted
    return out


class ShortConv(nn.Module):
    """A learned base kernel plus a per-position, per-channel-group correction predicted from the normed input."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, k, g = config.hidden_size, config.conv_kernel_size, config.conv_group_size
        self.kernel, self.groups = k, h // g
        base = torch.zeros(2, k, h)
        base[:, 0] = 1.0  # identity: tap 0 passes x_t through
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(h, 2 * k * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def around(self, h: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor], block_size: int) -> torch.Tensor:
        """conv_after(sublayer(conv_before(h))); h: normed sublayer input [b, T, H]."""
        delta = self.kernel_projection(h).view(*h.shape[:2], 2, self.kernel, self.groups)
        y = sublayer(grouped_conv(h, self.base_kernel[0], delta[:, :, 0], block_size))
        return grouped_conv(y, self.base_kernel[1], delta[:, :, 1], block_size)


class CandidateSelector(nn.Module):
    """Scores adjacent pairs: S_t(a, b) = U_t(b) + ⟨pred[a] ⊙ W h_t, succ[b]⟩ over each position's top-k candidates."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        r = config.selector_rank
        self.top_k = config.selector_top_k
        self.hidden_projection = nn.Linear(config.hidden_size, r, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.randn(config.vocab_size, r) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(config.vocab_size, r) * 0.02)
        nn.init.zeros_(self.hidden_projection.weight)  # pair term 0: starts as plain top-1 drafting

    def pair_scores(self, hidden: torch.Tensor, prev: torch.Tensor, cand: torch.Tensor,
                    cand_scores: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], prev [...], cand [..., k], cand_scores [..., k] → S(prev, cand) [..., k]."""
        w = self.hidden_projection.weight  # scores in float32 whatever the drafter's dtype (bf16 drafters too)
        ctx = self.predecessor_codebook[prev].float() * self.hidden_projection(hidden.to(w.dtype)).float()  # [..., r]
        return cand_scores + torch.einsum("...r,...kr->...k", ctx, self.successor_codebook[cand].float())

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int, temperature: float,
             gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Left-to-right path over positions 1..B-1: hidden [B-1, H], logits [B-1, V] → drafts [B-1], q [B-1, V] or None.

        Greedy takes argmax S_t(prev, ·); sampling draws from softmax(S_t / T) over the k candidates, which is q.
        """
        k = min(self.top_k, logits.shape[-1])
        scores, cand = logits.float().topk(k, -1)  # [B-1, k]
        prev = torch.tensor(anchor, device=logits.device)
        drafts, qs = [], []
        for t in range(logits.shape[0]):
            s = self.pair_scores(hidden[t].float(), prev, cand[t], scores[t])
            if temperature == 0:
                j = s.argmax()
            else:
                probs = torch.softmax(s / temperature, -1)
                j = torch.multinomial(probs, 1, generator=gen)[0]
                qs.append(torch.zeros(logits.shape[-1], device=logits.device).scatter(0, cand[t], probs))
            prev = cand[t, j]
            drafts.append(prev)
        q = torch.stack(qs) if qs else None
        return torch.stack(drafts) if drafts else cand[:, 0], q


def selector_children(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor,
                      width: int) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """Tree children under DFlash 2: position d's top-k candidates rescored S_d(parent, ·), the best `width` of them.

    hidden [B-1, H], logits [B-1, V]; the log-probabilities are the softmax over the k candidates, the q of the walk.
    """
    k = min(selector.top_k, logits.shape[-1])
    scores, cand = logits.float().topk(k, -1)  # [B-1, k]

    def children(d: int, prev: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = selector.pair_scores(hidden[d].float(), torch.tensor(prev, device=cand.device), cand[d], scores[d])
        lp, j = torch.log_softmax(s, -1).topk(min(width, k))
        return lp, cand[d, j]

    return children


def selector_loss(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                  prev: torch.Tensor, w: torch.Tensor, vocab_ids: torch.Tensor | None = None,
                  insert_gold: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ w_t CE over position t's top-k candidates, scored S_t(true predecessor, ·), and the recall mask [m, B-1].

    hidden [m, B-1, H]; logits [m, B-1, V'] (over vocab_ids when a sampled softmax is used); labels / prev: true ids
    of x[a+t] and x[a+t-1]. Where the true token is not among the candidates, the position is skipped (inference
    could not pick it either), or with insert_gold it replaces the weakest candidate (with its own logit as score),
    so every position teaches the pair term. Candidate scores are detached: the block loss already trains them, this
    loss trains the pair term.
    """
    k = min(selector.top_k, logits.shape[-1])
    scores, idx = logits.detach().float().topk(k, -1)  # [m, B-1, k]
    cand = idx if vocab_ids is None else vocab_ids[idx]
    hit = cand == labels[..., None]
    found = hit.any(-1)  # [m, B-1]
    if insert_gold:
        gold = labels if vocab_ids is None else torch.searchsorted(vocab_ids, labels.contiguous())
        cand = torch.cat([cand[..., :-1], torch.where(found, cand[..., -1], labels)[..., None]], -1)
        last = torch.where(found, scores[..., -1], logits.detach().float().gather(-1, gold[..., None])[..., 0])
        scores = torch.cat([scores[..., :-1], last[..., None]], -1)
        hit = cand == labels[..., None]
    s = selector.pair_scores(hidden.float(), prev, cand, scores)
    ce = F.cross_entropy(s.flatten(0, 1), hit.float().argmax(-1).flatten(), reduction="none").view(found.shape)
    used = hit.any(-1)
    return (ce * used * w).sum(), found


def upgrade_to_dflash2(drafter: nn.Module, **dflash2_fields) -> nn.Module:
    """A DFlash 2 drafter that drafts exactly like `drafter` (identity convolutions, zero pair term)."""
    config = replace(drafter.config, arch="dflash2", **dflash2_fields)
    new = type(drafter)(config).to(dtype=next(drafter.parameters()).dtype, device=next(drafter.parameters()).device)
    missing, unexpected = new.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing), (missing, unexpected)
    return new.eval()
