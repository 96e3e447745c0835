"""Logits → processed probabilities, sampling, and the greedy / speculative-sampling verification rules."""

from __future__ import annotations

import torch

from .sampling_params import SamplingParams


def process(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] → float32 probabilities after temperature, top-k, then top-p (the same for p and q)."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token is always kept)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop_sorted[..., 0] = False  # explicitly: a top_p below float32's range (5e-324) rounds to 0 and would drop it
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """probs [..., V] → token ids [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=gen).reshape(probs.shape[:-1])


def accept_greedy(drafts: torch.Tensor, target_ids: torch.Tensor) -> tuple[int, int]:
    """drafts [k], target argmax ids [k+1] → (drafts kept, the target's next token)."""
    match = (drafts == target_ids[:-1]).int().cumprod(0)
    n = int(match.sum())
    return n, int(target_ids[n])


def accept_sampling(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                    gen: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling: drafts [k] drawn from q [k, V]; target p [k+1, V] → (drafts kept, next token).

    Keep draft j with probability min(1, p_j(x)/q_j(x)); at the first rejection draw from normalize(max(p - q, 0))
    (p itself if that is all zero); if all are kept, draw the bonus from p_k. The output follows p exactly.
    """
    k = drafts.shape[0]
    idx = torch.arange(k, device=drafts.device)
    px, qx = p[idx, drafts], q[idx, drafts]
    u = torch.rand(k, generator=gen, device=drafts.device)
    ok = (u * qx < px).int().cumprod(0)  # u < p/q without dividing by q (p = 0 always rejects)
    n = int(ok.sum())
    if n == k:
        return n, int(sample(p[k], gen))
    residual = (p[n] - q[n]).clamp_min(0)
    total = residual.sum()
    dist = residual / total if total > 0 else p[n]
    return n, int(sample(dist, gen))
