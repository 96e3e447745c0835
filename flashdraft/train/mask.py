"""Training-time anchors, block layout and attention masks (docs/design.md §4), as pure tensor functions.

Layout for one sequence of n positions and anchors a_0 < a_1 < ... (N of them), block size B:
queries are the N blocks [x_a, M, ..., M] concatenated (T = N * B), at absolute positions a_j + k;
keys are the n context positions (target features) followed by the same T block positions.
A query in block j sees context positions c < a_j and every position of block j (both directions),
never another block; each layer then applies its own causality and window (config.layer_attention), exactly as
inference does. Batches pad anchors to the same N; padded anchors are 0 and marked invalid.
"""

from __future__ import annotations

import torch

from ..config import layer_attention
from ..drafter import visible_keys


def eligible_anchors(loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """Anchors a whose whole block a..a+B-1 lies in the supervised region; loss_mask: [n] bool → [k] long."""
    n = loss_mask.shape[0]
    if n < block_size:
        return torch.zeros(0, dtype=torch.long)
    cs = torch.cat([loss_mask.new_zeros(1, dtype=torch.long), loss_mask.long().cumsum(0)])  # [n + 1]
    window = cs[block_size:] - cs[: n - block_size + 1]  # [n - B + 1] supervised count in a..a+B-1
    return torch.nonzero(window == block_size).flatten()


def sample_anchors(loss_mask: torch.Tensor, block_size: int, max_anchors: int, gen: torch.Generator) -> torch.Tensor:
    """Up to max_anchors distinct eligible anchors, uniformly at random, sorted; [k] long."""
    cand = eligible_anchors(loss_mask, block_size)
    if len(cand) > max_anchors:
        cand = cand[torch.randperm(len(cand), generator=gen)[:max_anchors]].sort().values
    return cand


def pad_anchors(anchors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence anchor lists → anchors [b, N] (padding 0) and valid [b, N] bool."""
    N = max(1, max(len(a) for a in anchors))
    out = torch.zeros(len(anchors), N, dtype=torch.long)
    valid = torch.zeros(len(anchors), N, dtype=torch.bool)
    for i, a in enumerate(anchors):
        out[i, : len(a)] = a
        valid[i, : len(a)] = True
    return out, valid


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """anchors [b, N] → absolute positions a_j + k of every block query, [b, N * B]."""
    k = torch.arange(block_size, device=anchors.device)
    return (anchors[..., None] + k).flatten(1)


def block_labels(ids: torch.Tensor, anchors: torch.Tensor, B: int) -> torch.Tensor:
    """x[a_j + k] for k = 1..B-1: ids [b, n], anchors [b, N] → [b, N, B-1] (padded anchors clamp in range)."""
    pos = block_positions(anchors, B).clamp(max=ids.shape[1] - 1)
    return ids.gather(1, pos).view(*anchors.shape, B)[..., 1:]


def stage_len(block_size: int, stage: int) -> int:
    """Block length of DLoop stage s: the anchor, (s-1)(B-1) revealed tokens and B-1 masks."""
    return (stage - 1) * (block_size - 1) + block_size


def training_mask(anchors: torch.Tensor, n_ctx: int, block_size: int) -> torch.Tensor:
    """Bool visibility [b, 1, T, n_ctx + T] for queries = all blocks, keys = n_ctx context positions + all blocks."""
    b, N = anchors.shape
    T = N * block_size
    dev = anchors.device
    q_anchor = anchors.repeat_interleave(block_size, 1)  # [b, T] the anchor of each query's block
    ctx = torch.arange(n_ctx, device=dev)[None, None, :] < q_anchor[:, :, None]  # [b, T, n_ctx]
    blk = torch.arange(T, device=dev) // block_size
    own = (blk[:, None] == blk[None, :]).expand(b, T, T)  # [b, T, T] block-diagonal
    return torch.cat([ctx, own], -1).unsqueeze(1)


def key_positions(anchors: torch.Tensor, n_ctx: int, block_size: int) -> torch.Tensor:
    """Absolute positions of all keys: context 0..n_ctx-1 then the blocks, [b, n_ctx + T]."""
    ctx = torch.arange(n_ctx, device=anchors.device)[None].expand(anchors.shape[0], -1)
    return torch.cat([ctx, block_positions(anchors, block_size)], 1)


def training_masks(layer_types: list[str], anchors: torch.Tensor, n_ctx: int, block_size: int,
                   sliding_window: int | None = None, is_causal: bool | None = None) -> dict[str, torch.Tensor]:
    """Masks per layer kind: the block layout above, narrowed by the layer's causality and window as at inference."""
    layout = training_mask(anchors, n_ctx, block_size)
    q_pos, k_pos = block_positions(anchors, block_size), key_positions(anchors, n_ctx, block_size)
    masks = {}
    for kind in {"full_attention", *layer_types}:
        causal, window = layer_attention(kind, is_causal, sliding_window)
        masks[kind] = layout & visible_keys(q_pos, k_pos, causal, window) if causal or window else layout
    return masks
