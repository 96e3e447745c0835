"""One micro-batch forward: target features (computed or stored), the drafter over every anchor block, the loss."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import nn

from .. import lean
from .. import target as T
from ..dflash2 import selector_loss
from .config import TrainConfig
from .data import Sequence, right_pad
from .loss import block_loss, remap_labels
from .mask import block_labels, block_positions, pad_anchors, stage_len, training_masks

RECALL_K = 16  # evaluation reports how often the true token is in a DFlash 1 drafter's top-16 (DFlash 2: its top-k)


def autocast(device: torch.device, dtype: torch.dtype):
    """Autocast to the compute dtype (none for float32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def target_features(model, ids: torch.Tensor, attn: torch.Tensor, layer_ids: list[int],
                    need_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Frozen target on right-padded ids [b, n] → features [b, n, F] and (if asked) logits [b, n, V]."""
    out = model(input_ids=ids, attention_mask=attn, output_hidden_states=True, logits_to_keep=0 if need_logits else 1)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1)
    return feats, (out.logits if need_logits else None)


@torch.no_grad()
def lean_features(lm: lean.LeanModel, model, ids: torch.Tensor, lengths: list[int],
                  layer_ids: list[int]) -> torch.Tensor:
    """The frozen target's features of each right-padded row of ids [b, n] alone: [b, n, F], zeros on padding.

    One causal pass per sequence through the lean forward, stopping after the last feature layer: no padded
    positions, no attention mask (2.4x faster than the padded HF batch on long ShareGPT contexts, bf16 CPU).
    """
    rows = []
    for row, m in zip(ids, lengths):
        pos = torch.arange(m, device=ids.device)[None]
        _, f = lean.lean_forward(lm, row[None, :m], pos, T.new_cache(model), None, layer_ids, logits=False)
        rows.append(nn.functional.pad(f[0], (0, 0, 0, ids.shape[1] - m)))
    return torch.stack(rows)


def drafter_hidden(drafter: nn.Module, raw: nn.Module, embed: nn.Module, feats: torch.Tensor, ids: torch.Tensor,
                   anchors: torch.Tensor, mask_id: int, block_len: int | None = None, known: int = 1) -> torch.Tensor:
    """One drafter pass over all anchor blocks: feats [b, n, F], ids [b, n], anchors [b, N] → hidden [b, N, L, h].

    A block is L = block_len (default B) positions a..a+L-1 whose first `known` inputs are the true tokens x[a..] and
    the rest the mask token: plain DFlash has known = 1 (the anchor); a DLoop stage s has L = s(B-1)+1 and
    known = L-B+1 (the teacher-forced prefix). `drafter` is what gets called (maybe DDP-wrapped); `raw` is the
    module itself (for context_kv / config).
    """
    drafter_config = raw.config
    L = block_len or drafter_config.block_size
    b, n = ids.shape
    ctx = raw.context_kv(feats, torch.arange(n, device=ids.device)[None].expand(b, n))
    pos = block_positions(anchors, L)  # [b, T]
    is_known = (torch.arange(pos.shape[1], device=ids.device) % L < known)[None].expand_as(pos)
    block_ids = torch.where(is_known, ids.gather(1, pos.clamp(max=n - 1)), mask_id)
    emb = embed(block_ids).to(torch.float32)
    masks = training_masks(drafter_config.layer_types, anchors, n, L, drafter_config.sliding_window,
                           drafter_config.is_causal)
    hidden = drafter(emb, pos, ctx, masks, L)
    return hidden.view(b, anchors.shape[1], L, -1)


class MicroInputs(NamedTuple):
    """A micro-batch's right-padded ids [b, n], target features [b, n, F] and optional teacher distributions."""

    ids: torch.Tensor
    feats: torch.Tensor
    target_logits: torch.Tensor | None  # online --kl-weight: the target's logits [b, n, V]
    stored_topk: tuple[torch.Tensor, torch.Tensor] | None  # offline --distill-weight: top-k ids, log-probs [b, n, K]


def stored_topk(seqs: list[Sequence], n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's stored top-k per token, right-padded: [b, n, K] ids and log-probs (padding: -60)."""
    k = seqs[0].topk_ids.shape[-1]
    ids = torch.zeros(len(seqs), n, k, dtype=torch.long)
    logprobs = torch.full((len(seqs), n, k), -60.0)
    for i, s in enumerate(seqs):
        ids[i, : len(s.input_ids)] = s.topk_ids.long()
        logprobs[i, : len(s.input_ids)] = s.topk_logprobs.float()
    return ids.to(device), logprobs.to(device)


def micro_inputs(target, raw: nn.Module, seqs: list[Sequence], cfg: TrainConfig, device: torch.device,
                 dtype: torch.dtype) -> MicroInputs:
    """Right-padded ids, target features (stored or computed) and the teacher distribution its loss terms need."""
    ids, attn = right_pad([s.input_ids for s in seqs])
    ids, attn = ids.to(device), attn.to(device)
    if cfg.offline:
        feats = torch.zeros(len(seqs), ids.shape[1], seqs[0].features.shape[-1], dtype=torch.bfloat16)
        for i, s in enumerate(seqs):
            feats[i, : len(s.input_ids)] = s.features
        soft = stored_topk(seqs, ids.shape[1], device) if cfg.distill_weight else None
        # float32 here; autocast lowers them again under bf16
        return MicroInputs(ids, feats.to(device=device, dtype=torch.float32), None, soft)
    lm = lean.current(target)
    if lm is not None and cfg.kl_weight == 0:
        feats = lean_features(lm, target, ids, [len(s.input_ids) for s in seqs], raw.config.target_layer_ids)
        return MicroInputs(ids, feats, None, None)
    with autocast(device, dtype):
        feats, tlogits = target_features(target, ids, attn, raw.config.target_layer_ids, cfg.kl_weight > 0)
    return MicroInputs(ids, feats, tlogits, None)


def target_rows(tlogits: torch.Tensor, a: torch.Tensor, valid: torch.Tensor, L: int, first: int) -> torch.Tensor:
    """The target's logits for each predicted block position: [M, B-1, V] (x[a+k] is predicted at a+k-1)."""
    tpos = (block_positions(a, L).view(*a.shape, L)[..., first - 1:-1])[valid]  # [M, B-1]
    bidx = torch.arange(len(a), device=a.device)[:, None].expand_as(a)[valid]
    return tlogits[bidx[:, None], tpos]


def stored_rows(stored: tuple[torch.Tensor, torch.Tensor], a: torch.Tensor, valid: torch.Tensor, L: int, first: int,
                n: int, vocab_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored top-k for each predicted block position, [M, B-1, K] (row t produced x[t]), in sampled-vocab ids."""
    tpos = block_positions(a, L).view(*a.shape, L)[..., first:].clamp(max=n - 1)
    bidx = torch.arange(len(a), device=a.device)[:, None, None].expand_as(tpos)
    s_ids, s_lp = stored[0][bidx, tpos][valid], stored[1][bidx, tpos][valid]  # [M, B-1, K]
    if vocab_ids is not None:  # ids outside a sampled softmax drop out of p (renormalised over the rest)
        pos = torch.searchsorted(vocab_ids, s_ids.contiguous()).clamp(max=len(vocab_ids) - 1)
        s_lp = torch.where(vocab_ids[pos] == s_ids, s_lp, torch.full_like(s_lp, -1e4))
        s_ids = pos
    return s_ids, s_lp


def loss_aux(raw: nn.Module, cfg: TrainConfig, w: torch.Tensor, y: torch.Tensor, labels: torch.Tensor,
             prev: torch.Tensor, vocab_ids: torch.Tensor | None):
    """The extra term of block_loss: DFlash 2's selector loss, else (evaluation only) top-k recall, else None."""
    selector = getattr(raw, "candidate_selector", None)
    if selector is not None:
        ws = w * cfg.selector_weight

        def aux(hh, logits, rows):
            return selector_loss(selector, hh, logits, labels[rows], prev[rows], ws, vocab_ids,
                                 cfg.selector_gold and torch.is_grad_enabled())
        return aux
    if torch.is_grad_enabled():
        return None

    def recall(hh, logits, rows):  # how often the top-k holds the true token
        k = logits.topk(min(RECALL_K, logits.shape[-1]), -1).indices
        return logits.new_zeros(()), (k == y[rows][..., None]).any(-1)
    return recall


def micro_loss(drafter: nn.Module, raw: nn.Module, target, inputs: MicroInputs, anchors: list[torch.Tensor],
               cfg: TrainConfig, w: torch.Tensor, device: torch.device, dtype: torch.dtype,
               vocab_ids: torch.Tensor | None = None, stage: int = 1):
    """Loss numerator, correctness [M, B-1] and (DFlash 2) top-k recall for a micro-batch's anchors at a loop stage.

    inputs: micro_inputs(...); vocab_ids: sorted ids of a sampled softmax (containing every label), or None for the
    full vocabulary; stage s > 1 predicts positions (s-1)(B-1)+1 .. s(B-1) from the revealed prefix (DLoop).
    """
    L = stage_len(raw.config.block_size, stage)
    first = L - raw.config.block_size + 1  # block offset of the first predicted position
    ids, feats, tlogits, stored = inputs
    a, valid = pad_anchors(anchors)
    a, valid = a.to(device), valid.to(device)
    lm_head, embed = T.lm_head(target), T.embed(target)
    vocab_ids = vocab_ids.to(device) if vocab_ids is not None else None
    w = w.to(device)
    with autocast(device, dtype):
        hidden = drafter_hidden(drafter, raw, embed, feats, ids, a, raw.config.mask_token_id, L, first)
        h = hidden[valid][:, first:]  # [M, B-1, h]
        block = block_labels(ids, a, L)[valid]  # x[a+1..a+L-1]
        labels = block[:, first - 1:]
        t = target_rows(tlogits, a, valid, L, first) if tlogits is not None else None
        y = remap_labels(labels, vocab_ids) if vocab_ids is not None else labels
        soft = stored_rows(stored, a, valid, L, first, ids.shape[1], vocab_ids) if stored is not None else None
        prev = torch.cat([ids.gather(1, a)[valid][:, None], block], 1)[:, first - 1:L - 1]  # x[a+k-1] (k=1: anchor)
        aux = loss_aux(raw, cfg, w, y, labels, prev, vocab_ids)
        return block_loss(h, y, w, lambda x: raw.logits(x, lm_head, vocab_ids), t, cfg.kl_weight, cfg.loss_chunk,
                          aux, soft, cfg.distill_weight)
