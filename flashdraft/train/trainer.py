"""Drafter training loop (DESIGN.md §4): frozen target, block-diffusion drafter, AdamW + warmup/cosine, DDP.

Determinism: the data order of step s and every sequence's anchors are pure functions of (seed, s, index), so a
run resumed from a checkpoint (fp32 weights, optimizer, scheduler, RNG, step) continues bit-for-bit, and N DDP
ranks see exactly the global batch one process would (rank r takes every N-th sequence; the loss is normalised by
the global block count, so averaged DDP gradients equal the single-process gradient).

Checkpoints: OUT/step_0000100/ holds config.json + model.safetensors (z-lab format, --save-dtype, loadable as
--drafter) and train_state.pt (fp32 weights, optimizer, scheduler, RNG, step, settings); OUT/latest names the
newest. OUT/metrics.jsonl gets one JSON line per log / eval.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .. import target as T
from ..atomic import atomic_dir, write_text
from ..checkpoint import build_drafter, check_compatible, load_drafter, parse_dtype, save_drafter
from ..config import drafter_config_for
from ..dflash2 import selector_loss, upgrade_to_dflash2
from ..errors import FlashdraftError
from .data import Sequence, data_dirs, load_all, read_meta, right_pad
from .loss import (block_loss, loss_vocabulary, mean_loss, position_accuracy, position_weights, remap_labels,
                   tau_hat)
from .mask import block_positions, eligible_anchors, pad_anchors, sample_anchors, training_masks

RECALL_K = 16  # evaluation reports how often the true token is in a DFlash 1 drafter's top-16 (DFlash 2: its top-k)

# settings that must not change when resuming (they change the data order, the model or the schedule)
RESUME_KEYS = ("data", "num_layers", "block_size", "mask_token_id", "steps", "batch_size", "lr", "min_lr_ratio",
               "warmup_steps", "weight_decay", "anchors", "gamma", "kl_weight", "seed", "offline", "eval_sequences",
               "loss_vocab", "target_init", "arch", "selector_rank", "selector_top_k", "selector_weight", "loop_stages",
               "distill_weight", "selector_gold")
# ... of which --extend lets these change: the data may have grown and the run may be made longer
EXTEND_KEYS = ("data", "steps", "warmup_steps")


@dataclass
class TrainConfig:
    """Everything a training run depends on (CLI flags map 1:1)."""

    data: str | list[str]  # one prepared directory, or several trained on together
    out: str
    target: str | None = None
    init_from: str | None = None
    num_layers: int | None = None  # new drafters: 2; with init_from: keep its first N or grow to N (None: all)
    block_size: int | None = None  # None: 16, or the --init-from drafter's
    mask_token_id: int | None = None
    steps: int = 1000
    batch_size: int = 8  # sequences per optimizer step, over all ranks
    micro_batch: int | None = None  # sequences per forward on one rank (None: all of the rank's share)
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None  # None: 4% of steps
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    anchors: int = 512
    gamma: float | None = None
    kl_weight: float = 0.0
    dtype: str = "bfloat16"  # compute dtype (target and drafter autocast); master weights stay fp32
    save_dtype: str = "bfloat16"
    offline: bool = False
    eval_sequences: int = 32
    eval_every: int = 100
    log_every: int = 10
    save_every: int = 500
    keep_last: int = 3
    seed: int = 0
    resume: bool = False
    stop_after: int | None = None  # stop after this many steps in this run (checkpointing first)
    device: str | None = None
    loss_chunk: int = 4096  # logits rows per checkpointed chunk of the loss
    arch: str | None = None  # "dflash" | "dflash2"; None: dflash, or the --init-from drafter's
    selector_rank: int | None = None  # DFlash 2 (None: the config default, or the --init-from drafter's)
    selector_top_k: int | None = None
    selector_weight: float = 1.0  # DFlash 2: weight of the candidate-selector loss
    loop_stages: int = 1  # DLoop: also train a later stage (2..S) on a teacher-forced prefix each step
    target_init: bool = False  # warm-start a fresh drafter's layers from the target's last layers
    loss_vocab: int = 0  # >0: sampled softmax over the N most frequent training tokens (+ labels, + N/4 random ids)
    distill_weight: float = 0.0  # offline: add this times CE against the target's stored top-k distribution
    selector_gold: bool = False  # DFlash 2: a true token missing from the candidates replaces the weakest one
    extend: bool = False  # with resume: accept grown data and a larger --steps
    dev_prompts: str | None = None  # JSONL of held-out prompts for real-τ selection (default: DATA/dev.jsonl)
    dev_samples: int = 16  # first N dev prompts, decoded speculatively in float32 at every dev evaluation
    dev_max_new_tokens: int = 128
    dev_every: int | None = None  # steps between dev evaluations (default: --save-every); 0 = never
    time_limit: float | None = None  # minutes: stop with a checkpoint once this run has trained this long
    draft_vocab: int = 0  # >0: checkpoints propose only the N most frequent response tokens (draft_vocab.json)


# ---------------------------------------------------------------- mask token

def pick_mask_token_id(tokenizer, vocab_rows: int) -> int:
    """The first embedding row beyond the tokenizer if there is one, else the highest-id unused special token.

    "Unused" means an added special token that is not bos/eos/pad/unk and does not occur in the chat template
    (for SmolLM2 that is `<empty_output>`, id 16).
    """
    n = len(tokenizer)
    if vocab_rows > n:
        return n
    taken = {getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk")}
    template = str(getattr(tokenizer, "chat_template", None) or "")
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    cands = [i for i, t in decoder.items()
             if getattr(t, "special", False) and i not in taken and i < vocab_rows and str(t) not in template]
    if not cands:
        raise FlashdraftError("the target has no spare embedding row or unused special token for the mask token; "
                              "pass --mask-token-id ID")
    return max(cands)


# ---------------------------------------------------------------- data order

@functools.lru_cache(maxsize=4)
def _perm(seed: int, epoch: int, n: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()


def step_indices(step: int, n: int, batch: int, seed: int) -> list[int]:
    """Global batch of training-set indices for step `step` (an endless stream of per-epoch permutations)."""
    out = []
    for t in range(step * batch, (step + 1) * batch):
        epoch, r = divmod(t, n)
        out.append(_perm(seed, epoch, n)[r])
    return out


def anchor_generator(seed: int, step: int, index: int) -> torch.Generator:
    """Anchors of sequence `index` at step `step` depend on nothing else (resume / DDP reproducible)."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 10_000_019 + index) % (1 << 62))


def split_eval(n: int, n_eval: int, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic held-out split: (train indices, eval indices)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 12345)).tolist()
    n_eval = min(n_eval, n // 10) if n >= 2 else 0
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))


# ---------------------------------------------------------------- forward pieces

@torch.no_grad()
def target_features(model, ids: torch.Tensor, attn: torch.Tensor, layer_ids: list[int],
                    need_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Frozen target on right-padded ids [b, n] → features [b, n, F] and (if asked) logits [b, n, V]."""
    out = model(input_ids=ids, attention_mask=attn, output_hidden_states=True, logits_to_keep=0 if need_logits else 1)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1)
    return feats, (out.logits if need_logits else None)


def drafter_hidden(drafter: nn.Module, raw: nn.Module, embed: nn.Module, feats: torch.Tensor, ids: torch.Tensor,
                   anchors: torch.Tensor, mask_id: int, block_len: int | None = None, known: int = 1) -> torch.Tensor:
    """One drafter pass over all anchor blocks: feats [b, n, F], ids [b, n], anchors [b, N] → hidden [b, N, L, h].

    A block is L = block_len (default B) positions a..a+L-1 whose first `known` inputs are the true tokens x[a..] and
    the rest the mask token: plain DFlash has known = 1 (the anchor); a DLoop stage s has L = s(B-1)+1 and
    known = L-B+1 (the teacher-forced prefix). `drafter` is what gets called (maybe DDP-wrapped); `raw` is the
    module itself (for context_kv / config).
    """
    cfg = raw.config
    L = block_len or cfg.block_size
    b, n = ids.shape
    ctx = raw.context_kv(feats, torch.arange(n, device=ids.device)[None].expand(b, n))
    pos = block_positions(anchors, L)  # [b, T]
    is_known = (torch.arange(pos.shape[1], device=ids.device) % L < known)[None].expand_as(pos)
    block_ids = torch.where(is_known, ids.gather(1, pos.clamp(max=n - 1)), mask_id)
    emb = embed(block_ids).to(torch.float32)
    masks = training_masks(cfg.layer_types, anchors, n, L, cfg.sliding_window, cfg.is_causal)
    hidden = drafter(emb, pos, ctx, masks, L)
    return hidden.view(b, anchors.shape[1], L, -1)


def block_labels(ids: torch.Tensor, anchors: torch.Tensor, B: int) -> torch.Tensor:
    """x[a_j + k] for k = 1..B-1: ids [b, n], anchors [b, N] → [b, N, B-1] (padded anchors clamp in range)."""
    pos = block_positions(anchors, B).clamp(max=ids.shape[1] - 1)
    return ids.gather(1, pos).view(*anchors.shape, B)[..., 1:]


def autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def stage_len(block_size: int, stage: int) -> int:
    """Block length of DLoop stage s: the anchor, (s-1)(B-1) revealed tokens and B-1 masks."""
    return (stage - 1) * (block_size - 1) + block_size


def loop_stage(seed: int, step: int, loop_stages: int) -> int:
    """The later stage trained at `step` (uniform over 2..S, a pure function of seed and step), or 1 without looping."""
    if loop_stages < 2:
        return 1
    return 2 + int(torch.randint(loop_stages - 1, (1,), generator=anchor_generator(seed, step, -2)))


def micro_inputs(target, raw: nn.Module, seqs: list[Sequence], cfg: TrainConfig, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Right-padded ids [b, n], target features [b, n, F] (stored or computed) and, for the KL term, target logits."""
    ids, attn = right_pad([s.input_ids for s in seqs])
    ids, attn = ids.to(device), attn.to(device)
    if cfg.offline:
        feats = torch.zeros(len(seqs), ids.shape[1], seqs[0].features.shape[-1], dtype=torch.bfloat16)
        for i, s in enumerate(seqs):
            feats[i, : len(s.input_ids)] = s.features
        soft = None
        if cfg.distill_weight:  # the target's stored top-k per token: [b, n, K] ids and log-probs
            k = seqs[0].topk_ids.shape[-1]
            tk_ids = torch.zeros(len(seqs), ids.shape[1], k, dtype=torch.long)
            tk_lp = torch.full((len(seqs), ids.shape[1], k), -60.0)
            for i, s in enumerate(seqs):
                tk_ids[i, : len(s.input_ids)] = s.topk_ids.long()
                tk_lp[i, : len(s.input_ids)] = s.topk_logprobs.float()
            soft = (tk_ids.to(device), tk_lp.to(device))
        return ids, feats.to(device=device, dtype=torch.float32), None, soft  # autocast lowers feats again in bf16
    with autocast(device, dtype):
        feats, tlogits = target_features(target, ids, attn, raw.config.target_layer_ids, cfg.kl_weight > 0)
    return ids, feats, tlogits, None


def micro_loss(drafter: nn.Module, raw: nn.Module, target, inputs: tuple, anchors: list[torch.Tensor],
               cfg: TrainConfig, w: torch.Tensor, device: torch.device, dtype: torch.dtype,
               vocab_ids: torch.Tensor | None = None, stage: int = 1):
    """Loss numerator, correctness [M, B-1] and (DFlash 2) top-k recall for a micro-batch's anchors at a loop stage.

    inputs: micro_inputs(...); vocab_ids: sorted ids of a sampled softmax (containing every label), or None for the
    full vocabulary; stage s > 1 predicts positions (s-1)(B-1)+1 .. s(B-1) from the revealed prefix (DLoop).
    """
    B = raw.config.block_size
    L = stage_len(B, stage)
    first = L - B + 1  # block offset of the first predicted position
    ids, feats, tlogits, stored = inputs
    a, valid = pad_anchors(anchors)
    a, valid = a.to(device), valid.to(device)
    lm_head, embed = T.lm_head(target), T.embed(target)
    with autocast(device, dtype):
        hidden = drafter_hidden(drafter, raw, embed, feats, ids, a, raw.config.mask_token_id, L, first)
        h = hidden[valid][:, first:]  # [M, B-1, h]
        block = block_labels(ids, a, L)[valid]  # x[a+1..a+L-1]
        labels = block[:, first - 1:]
        t = None
        if tlogits is not None:  # the target's distribution for x[a+k] sits at position a+k-1
            tpos = (block_positions(a, L).view(*a.shape, L)[..., first - 1:-1])[valid]  # [M, B-1]
            bidx = torch.arange(len(ids), device=device)[:, None].expand_as(a)[valid]
            t = tlogits[bidx[:, None], tpos]
        y = labels
        if vocab_ids is not None:
            vocab_ids = vocab_ids.to(device)
            y = remap_labels(labels, vocab_ids)
        soft = None
        if stored is not None:  # row t of the stored top-k is the distribution that produced x[t]
            tpos = block_positions(a, L).view(*a.shape, L)[..., first:].clamp(max=ids.shape[1] - 1)
            bidx = torch.arange(len(ids), device=device)[:, None, None].expand_as(tpos)
            s_ids, s_lp = stored[0][bidx, tpos][valid], stored[1][bidx, tpos][valid]  # [M, B-1, K]
            if vocab_ids is not None:  # ids outside a sampled softmax drop out of p (renormalised over the rest)
                pos = torch.searchsorted(vocab_ids, s_ids.contiguous()).clamp(max=len(vocab_ids) - 1)
                s_lp = torch.where(vocab_ids[pos] == s_ids, s_lp, torch.full_like(s_lp, -1e4))
                s_ids = pos
            soft = (s_ids, s_lp)
        aux = None
        selector = getattr(raw, "candidate_selector", None)
        if selector is None and not torch.is_grad_enabled():  # evaluation: how often top-k holds the true token

            def aux(hh, logits, rows):
                k = logits.topk(min(RECALL_K, logits.shape[-1]), -1).indices
                return logits.new_zeros(()), (k == y[rows][..., None]).any(-1)
        if selector is not None:  # the true predecessor of x[a+k] is x[a+k-1] (the anchor for k = 1)
            prev = torch.cat([ids.gather(1, a)[valid][:, None], block], 1)[:, first - 1:L - 1]  # x[a+k-1]
            ws = w.to(device) * cfg.selector_weight

            def aux(hh, logits, rows):
                return selector_loss(selector, hh, logits, labels[rows], prev[rows], ws, vocab_ids,
                                     cfg.selector_gold and torch.is_grad_enabled())
        num, correct, recall = block_loss(h, y, w.to(device), lambda x: raw.logits(x, lm_head, vocab_ids), t,
                                          cfg.kl_weight, cfg.loss_chunk, aux, soft, cfg.distill_weight)
    return num, correct, recall


# ---------------------------------------------------------------- setup

def dist_info() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def build_or_load_drafter(cfg: TrainConfig, target) -> nn.Module:
    """A fresh drafter shaped for the target, or --init-from DIR (a DFlash 1 drafter upgrades exactly to --arch
    dflash2: identity convolutions and a zero pair term); fp32 master weights."""
    model, tok = target.model, target.tokenizer
    vocab = T.vocab_size(model)
    if cfg.arch not in (None, "dflash", "dflash2"):
        raise FlashdraftError(f"--arch must be dflash or dflash2, got {cfg.arch!r}")
    d2 = {k: v for k, v in (("selector_rank", cfg.selector_rank), ("selector_top_k", cfg.selector_top_k))
          if v is not None}
    if cfg.init_from:
        drafter = load_drafter(cfg.init_from, dtype=torch.float32)
        if cfg.arch == "dflash" and drafter.config.arch == "dflash2":
            raise FlashdraftError(f"--init-from {cfg.init_from} is a DFlash 2 drafter; use --arch dflash2 (or omit --arch)")
        if cfg.arch == "dflash2" and drafter.config.arch == "dflash":
            drafter = upgrade_to_dflash2(drafter, **d2)
        if cfg.num_layers is not None:
            set_num_layers(drafter, cfg.num_layers)
        dc = drafter.config
        if cfg.block_size is not None:
            dc.block_size = cfg.block_size
        if cfg.mask_token_id is not None:
            dc.mask_token_id = cfg.mask_token_id
        dc.torch_dtype = "float32"
    else:
        mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else pick_mask_token_id(tok, vocab)
        dc = drafter_config_for(model.config, mask_id, num_layers=cfg.num_layers or 2, block_size=cfg.block_size or 16,
                                torch_dtype="float32")
        dc.arch = cfg.arch or "dflash"
        for k, v in d2.items():
            setattr(dc, k, v)
        torch.manual_seed(cfg.seed)
        drafter = build_drafter(dc).float()
        init_from_target(drafter, model, cfg.target_init)
    check_compatible(dc, T.num_layers(model), T.hidden_size(model), vocab, cfg.init_from or "drafter")
    if dc.block_size < 2:
        raise FlashdraftError(f"--block-size must be >= 2 for training, got {dc.block_size}")
    if cfg.loop_stages > 1 and dc.arch == "dflash2":
        raise FlashdraftError("--loop-stages > 1 trains DFlash 1 drafters only; use a DFlash 1 drafter or --loop-stages 1")
    return drafter


def set_num_layers(drafter: nn.Module, n: int) -> None:
    """Keep the warm start's first n layers, or append layers that start as the identity (so drafts are unchanged).

    An appended layer copies the last one with its output projections (attention o_proj, MLP down_proj) zeroed: its
    residual branches add exactly 0 until training moves them, the zero-init residual trick of depth growth.
    """
    cfg, have = drafter.config, len(drafter.layers)
    if n <= have:
        drafter.layers = drafter.layers[:n]
        cfg.layer_types = list(cfg.layer_types[:n])
    else:
        for _ in range(n - have):
            layer = copy.deepcopy(drafter.layers[have - 1])
            with torch.no_grad():
                for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    proj.weight.zero_()
                    if proj.bias is not None:
                        proj.bias.zero_()
            drafter.layers.append(layer)
        cfg.layer_types = list(cfg.layer_types) + [cfg.layer_types[have - 1]] * (n - have)
    cfg.num_hidden_layers = n


def init_from_target(drafter: nn.Module, model, copy_layers: bool) -> list[str]:
    """Warm-start a fresh drafter from the frozen target; returns the names of the tensors copied.

    Always: the final norm (so the first logits have the LM head's scale). With copy_layers: drafter layer i gets the
    weights of target layer L - n + i wherever names and shapes agree (attention, MLP, norms), and `fc` starts as the
    identity on the last selected feature layer, so the context stream begins as the target's own deep states.
    """
    src = {f"norm.{k}": v for k, v in (T.final_norm(model) or nn.Module()).state_dict().items()}
    layers = getattr(getattr(model, "model", None), "layers", None)
    if copy_layers and layers is not None:
        n = len(drafter.layers)
        for i in range(n):
            src.update({f"layers.{i}.{k}": v for k, v in layers[len(layers) - n + i].state_dict().items()})
    own = drafter.state_dict()
    copied = [k for k, v in src.items() if k in own and own[k].shape == v.shape]
    with torch.no_grad():
        for k in copied:
            own[k].copy_(src[k].float())
        h = drafter.config.hidden_size
        if copy_layers and drafter.fc.weight.shape[1] >= h:
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, -h:] = torch.eye(h)
            copied.append("fc.weight")
    return copied


def frequent_tokens(seqs: list[Sequence], n: int, vocab: int) -> torch.Tensor:
    """The n most frequent response-token ids of the training set (ties by id, so deterministic)."""
    counts = torch.bincount(torch.cat([s.input_ids[s.loss_mask.bool()] for s in seqs]), minlength=vocab)
    order = torch.argsort(-counts, stable=True)
    return order[: min(n, int((counts > 0).sum()))].sort().values


def check_config(cfg: TrainConfig, world: int) -> None:
    for name in ("steps", "batch_size", "anchors", "num_layers", "log_every", "eval_every", "save_every", "loss_chunk"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise FlashdraftError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.micro_batch is not None and cfg.micro_batch < 1:
        raise FlashdraftError(f"--micro-batch must be >= 1, got {cfg.micro_batch}")
    if cfg.lr <= 0:
        raise FlashdraftError(f"--lr must be > 0, got {cfg.lr}")
    if cfg.batch_size % world:
        raise FlashdraftError(f"--batch-size {cfg.batch_size} must be a multiple of the number of processes ({world})")
    if cfg.loop_stages < 1:
        raise FlashdraftError(f"--loop-stages must be >= 1 (1 = plain DFlash), got {cfg.loop_stages}")
    if cfg.draft_vocab < 0:
        raise FlashdraftError(f"--draft-vocab must be >= 0 (0 = whole vocabulary), got {cfg.draft_vocab}")
    if cfg.loss_vocab < 0:
        raise FlashdraftError(f"--loss-vocab must be >= 0 (0 = full vocabulary), got {cfg.loss_vocab}")
    if cfg.loss_vocab and cfg.kl_weight > 0:
        raise FlashdraftError("--kl-weight needs the full vocabulary: drop --loss-vocab")
    if cfg.offline and cfg.kl_weight > 0:
        raise FlashdraftError("--kl-weight needs the target's logits: train online (without --offline), or use "
                              "--distill-weight with data prepared with --topk")
    if cfg.distill_weight < 0 or (cfg.distill_weight and not cfg.offline):
        raise FlashdraftError("--distill-weight needs --offline data prepared with --topk K, and must be >= 0")
    if cfg.extend and not cfg.resume:
        raise FlashdraftError("--extend only applies with --resume")
    if cfg.time_limit is not None and cfg.time_limit <= 0:
        raise FlashdraftError(f"--time-limit must be > 0 minutes, got {cfg.time_limit}")
    if cfg.dev_samples < 1 or cfg.dev_max_new_tokens < 1 or (cfg.dev_every is not None and cfg.dev_every < 0):
        raise FlashdraftError("--dev-samples and --dev-max-new-tokens must be >= 1 and --dev-every >= 0")
    parse_dtype(cfg.dtype)
    parse_dtype(cfg.save_dtype)


def prepare_sequences(cfg: TrainConfig, drafter_cfg, vocab: int) -> tuple[list[Sequence], list[Sequence]]:
    """Load the data, keep sequences with at least one whole supervised block, split off the held-out set."""
    where = " + ".join(data_dirs(cfg.data))
    for d in data_dirs(cfg.data) if cfg.offline else []:
        stored = read_meta(d).get("feature_layer_ids")
        if stored != list(drafter_cfg.target_layer_ids):
            raise FlashdraftError(f"{d} stores features of target layers {stored} but the drafter needs "
                                  f"{drafter_cfg.target_layer_ids}; re-run prepare --features with --feature-layer-ids "
                                  f"{','.join(map(str, drafter_cfg.target_layer_ids))} or train online")
    seqs = load_all(cfg.data, features=cfg.offline, topk=cfg.distill_weight > 0)
    top = max(int(s.input_ids.max()) for s in seqs)
    if top >= vocab:
        raise FlashdraftError(f"{where} has token id {top} outside the target vocabulary 0..{vocab - 1}; "
                              "it was prepared with a different target")
    B = drafter_cfg.block_size
    seqs = [s for s in seqs if len(eligible_anchors(s.loss_mask, B))]
    if len(seqs) < 2:
        raise FlashdraftError(f"{where} has {len(seqs)} sequence(s) with a response of at least {B} tokens; "
                              "need more data or a smaller --block-size")
    tr, ev = split_eval(len(seqs), cfg.eval_sequences, cfg.seed)
    return [seqs[i] for i in tr], [seqs[i] for i in ev]


# ---------------------------------------------------------------- checkpoints

def save_checkpoint(out: Path, step: int, drafter: nn.Module, opt, sched, cfg: TrainConfig, n_seqs: int,
                    cpu_s: float = 0.0, best: dict | None = None) -> Path:
    """OUT/step_N: z-lab drafter files + train_state.pt, atomically; then OUT/latest and pruning."""
    path = out / f"step_{step:07d}"
    state = {"step": step, "num_sequences": n_seqs, "cpu_s": cpu_s, "best": best,
             "model": {k: v.detach().cpu().clone() for k, v in drafter.state_dict().items()},
             "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "config": asdict(cfg),
             "rng": {"torch": torch.get_rng_state(),
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}
    with atomic_dir(path) as tmp:
        save_drafter(drafter, tmp, dtype=cfg.save_dtype)
        torch.save(state, tmp / "train_state.pt")
    drafter.config.torch_dtype = "float32"
    write_text(out / "latest", path.name + "\n")
    steps = sorted(p for p in out.glob("step_*") if p.is_dir() and not p.name.startswith("."))
    for old in steps[: max(0, len(steps) - cfg.keep_last)]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def latest_checkpoint(out: Path) -> Path | None:
    f = out / "latest"
    if not f.is_file():
        return None
    path = out / f.read_text().strip()
    return path if (path / "train_state.pt").is_file() else None


def load_state(path: Path, cfg: TrainConfig) -> dict:
    """train_state.pt, checked against the settings that must not change on resume."""
    try:
        state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as e:
        raise FlashdraftError(f"{path}/train_state.pt is unreadable ({e}); resume from an older step_* directory") from None
    old = state.get("config", {})
    defaults = TrainConfig(data="", out="")  # keys added after a run started count as their defaults
    def norm(k: str, v):  # num_layers: runs from before it could be None stored the then-default 2
        return (2 if v is None else v) if k == "num_layers" else v

    diff = [k for k in RESUME_KEYS if norm(k, old.get(k, getattr(defaults, k))) != norm(k, getattr(cfg, k))
            and not (cfg.extend and k in EXTEND_KEYS)]
    if cfg.extend and cfg.steps < state["step"]:
        raise FlashdraftError(f"--extend: --steps {cfg.steps} is below the {state['step']} steps already trained")
    if diff:
        raise FlashdraftError(f"--resume: {', '.join(f'{k} was {old.get(k)!r} now {getattr(cfg, k)!r}' for k in diff)}; "
                              "use the original settings or a new --out")
    return state


# ---------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(raw: nn.Module, target, seqs: list[Sequence], cfg: TrainConfig, w: torch.Tensor,
             device: torch.device, dtype: torch.dtype, stage: int = 1) -> dict:
    """Held-out loss, per-position accuracy and τ̂ with fixed anchors (identical every call), at a loop stage."""
    if not seqs:
        return {}
    B = stage_len(raw.config.block_size, stage)
    mb = cfg.micro_batch or max(1, cfg.batch_size)
    num, correct, recall, n_blocks = 0.0, [], [], 0
    for i in range(0, len(seqs), mb):
        part = seqs[i:i + mb]
        anchors = [sample_anchors(s.loss_mask, B, cfg.anchors, anchor_generator(cfg.seed, -1, i + j))
                   for j, s in enumerate(part)]
        inputs = micro_inputs(target, raw, part, cfg, device, dtype)
        n, c, r = micro_loss(raw, raw, target, inputs, anchors, cfg, w, device, dtype, stage=stage)
        num += float(n)
        correct.append(c.cpu())
        if r is not None:
            recall.append(r.cpu())
        n_blocks += sum(len(a) for a in anchors)
    c = torch.cat(correct)
    acc = position_accuracy(c)
    out = {"loss": float(mean_loss(torch.tensor(num), n_blocks, w)), "acc": float(c.float().mean()),
           "acc_pos": [round(float(x), 4) for x in acc], "tau": tau_hat(c), "blocks": n_blocks}
    if recall:  # how often the true token is among the top-k (DFlash 2: the selector's candidates)
        out["topk_recall_pos"] = [round(float(x), 4) for x in position_accuracy(torch.cat(recall))]
    return out


# ---------------------------------------------------------------- selection by real τ on held-out prompts

def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads): the compute a run has cost."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def dev_setup(cfg: TrainConfig, target, is_main: bool, say) -> dict | None:
    """The dev prompts (--dev-prompts, else every DATA/dev.jsonl, interleaved so each source counts) as ids and a
    float32 target to decode them with."""
    if not is_main or cfg.dev_every == 0:
        return None
    if cfg.dev_prompts and not Path(cfg.dev_prompts).is_file():
        raise FlashdraftError(f"--dev-prompts {cfg.dev_prompts} does not exist")
    paths = [Path(cfg.dev_prompts)] if cfg.dev_prompts else \
        [Path(d) / "dev.jsonl" for d in data_dirs(cfg.data) if (Path(d) / "dev.jsonl").is_file()]
    if not paths:
        return None
    from .data import interleave, read_jsonl_prompts

    prompts = interleave([read_jsonl_prompts(p) for p in paths])[: cfg.dev_samples]
    where = " + ".join(map(str, paths))
    dev_target = target
    if next(target.model.parameters()).dtype != torch.float32:  # τ is measured as it will be served: float32
        from ..models import load_target

        dev_target = load_target(cfg.target, dtype="float32", device=str(next(target.model.parameters()).device))
    say(f"flashdraft: dev τ on {len(prompts)} prompts of {where}, {cfg.dev_max_new_tokens} new tokens, float32",
        file=sys.stderr)
    return {"target": dev_target, "ids": [dev_target.encode(p) for p in prompts]}


@torch.no_grad()
def dev_tau(drafter: nn.Module, dev: dict, max_new_tokens: int) -> tuple[float, int]:
    """Pooled τ of real greedy speculative decoding over the dev prompts: (τ, cycles)."""
    from ..decoding import generate_ids

    target = dev["target"]
    lengths: list[int] = []
    for ids in dev["ids"]:
        r = generate_ids(target.model, drafter, ids, max_new_tokens=max_new_tokens,
                         stop_token_ids=target.stop_token_ids())
        lengths += r.acceptance_lengths
    return (sum(lengths) / len(lengths) if lengths else float("nan")), len(lengths)


def dev_evaluate(drafter: nn.Module, dev: dict, cfg: TrainConfig, out: Path, step: int, cpu_s: float,
                 best: dict | None, metrics_file: Path, say) -> dict | None:
    """Measure dev τ, log it with the CPU-hours spent so far, and keep OUT/best when it improves; returns the best."""
    was_training = drafter.training
    drafter.eval()
    t0 = time.perf_counter()
    tau, cycles = dev_tau(drafter, dev, cfg.dev_max_new_tokens)
    drafter.train(was_training)
    row = {"step": step, "dev_tau": tau, "dev_cycles": cycles, "cpu_hours": cpu_s / 3600,
           "dev_s": time.perf_counter() - t0}
    improved = best is None or tau > best["dev_tau"]
    if improved:
        with atomic_dir(out / "best") as tmp:
            save_drafter(drafter, tmp, dtype=cfg.save_dtype)
            (tmp / "best.json").write_text(json.dumps(row) + "\n")
        drafter.config.torch_dtype = "float32"
        best = row
    note = f"new best → {out / 'best'}" if improved else f"best {best['dev_tau']:.3f} at step {best['step']}"
    say(f"step {step} | dev τ {tau:.3f} over {cycles} cycles ({row['dev_s']:.0f} s) | {row['cpu_hours']:.2f} CPU-h | "
        f"{note}",
        file=sys.stderr)
    with open(metrics_file, "a") as f:
        f.write(json.dumps(row) + "\n")
    return best


# ---------------------------------------------------------------- the loop

def train(cfg: TrainConfig, target=None, log=print) -> dict:
    """Train a drafter; returns final metrics. `target` may be passed in (tests), else --target is loaded."""
    rank, world, local_rank = dist_info()
    check_config(cfg, world)
    for d in data_dirs(cfg.data):
        read_meta(d)  # fail on a bad --data before loading any model
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if cfg.device:
        device = torch.device(cfg.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = parse_dtype(cfg.dtype)
    is_main = rank == 0
    say = log if is_main else (lambda *a, **k: None)

    if target is None:
        from ..models import load_target

        target = load_target(cfg.target, dtype=dtype, device=str(device))
    model = target.model.eval()
    for p in model.parameters():
        p.requires_grad_(False)

    drafter = build_or_load_drafter(cfg, target).to(device)
    dc = drafter.config
    train_seqs, eval_seqs = prepare_sequences(cfg, dc, T.vocab_size(model))
    n_seqs = len(train_seqs) + len(eval_seqs)
    if cfg.draft_vocab:  # inference only: the loss still covers the whole vocabulary (or --loss-vocab)
        drafter.draft_vocab = frequent_tokens(train_seqs, cfg.draft_vocab, T.vocab_size(model))
    B = dc.block_size
    w = position_weights(B, cfg.gamma)
    frequent = None
    if cfg.loss_vocab:  # + the mask token: its own logit starts high (the block input) and must be pushed down
        frequent = torch.cat([frequent_tokens(train_seqs, cfg.loss_vocab, T.vocab_size(model)),
                              torch.tensor([dc.mask_token_id])]).unique()
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, int(0.04 * cfg.steps))
    cfg.warmup_steps = warmup
    decay = [p for p in drafter.parameters() if p.dim() >= 2]
    no_decay = [p for p in drafter.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95),
                            eps=1e-8, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(lr_factor, warmup=warmup, total=cfg.steps,
                                                                     min_ratio=cfg.min_lr_ratio))
    out = Path(cfg.out)
    start, cpu_before, best = 0, 0.0, None
    if cfg.resume:
        ckpt = latest_checkpoint(out)
        if ckpt is None:
            say(f"flashdraft: nothing to resume in {out}; starting from step 0", file=sys.stderr)
        else:
            state = load_state(ckpt, cfg)
            if state.get("num_sequences", n_seqs) != n_seqs and cfg.extend:
                say(f"flashdraft: --extend: the data now has {n_seqs} usable sequences (was {state['num_sequences']}); "
                    "the data order continues over the new set", file=sys.stderr)
            elif state.get("num_sequences", n_seqs) != n_seqs:
                raise FlashdraftError(f"--resume: --data now has {n_seqs} usable sequences, the run started with "
                                      f"{state['num_sequences']}; resume with the same data or use a new --out")
            drafter.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            torch.set_rng_state(state["rng"]["torch"])
            if state["rng"].get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(state["rng"]["cuda"])
            start = state["step"]
            cpu_before, best = state.get("cpu_s", 0.0), state.get("best")
            say(f"flashdraft: resumed from {ckpt} at step {start}", file=sys.stderr)
    elif latest_checkpoint(out) is not None:
        raise FlashdraftError(f"{out} already holds checkpoints; pass --resume to continue or choose a new --out")

    ddp = nn.parallel.DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None) \
        if world > 1 else drafter
    n_params = sum(p.numel() for p in drafter.parameters())
    say(f"flashdraft: training {dc.num_hidden_layers}-layer drafter ({n_params / 1e6:.1f}M params, block {B}, "
        f"mask id {dc.mask_token_id}, target layers {dc.target_layer_ids}) on {len(train_seqs)} sequences "
        f"(+{len(eval_seqs)} held out), {world} process(es), {cfg.dtype}, {'offline' if cfg.offline else 'online'} features",
        file=sys.stderr)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
    metrics_file = out / "metrics.jsonl"
    last_stop = cfg.steps if cfg.stop_after is None else min(cfg.steps, start + cfg.stop_after)
    dev = dev_setup(cfg, target, is_main, say)
    dev_every = cfg.save_every if cfg.dev_every is None else cfg.dev_every
    cpu0 = cpu_seconds()
    if dev is not None and start == 0:  # the curve's origin: the initial (e.g. --init-from) drafter
        best = dev_evaluate(drafter, dev, cfg, out, 0, cpu_before, best, metrics_file, say)
    mb = cfg.micro_batch or cfg.batch_size // world
    acc_num = acc_blocks = acc_tok = 0.0
    acc_correct: list[torch.Tensor] = []
    t_log = time.perf_counter()
    t_start, step_start, last_logged = t_log, start, start
    result: dict = {}
    drafter.train()
    interrupted = []  # SIGTERM (what `kill` and schedulers send; background jobs ignore SIGINT) ends the run cleanly
    on_term = signal.signal(signal.SIGTERM, lambda *_: interrupted.append(True)) \
        if threading.current_thread() is threading.main_thread() else None
    stopped_early = False
    for step in range(start, last_stop):
        if interrupted or (cfg.time_limit is not None and time.perf_counter() - t_start > cfg.time_limit * 60):
            last_stop, stopped_early = step, True  # checkpointed below as the last step of this run
            why = "SIGTERM" if interrupted else f"--time-limit {cfg.time_limit:g} min"
            say(f"flashdraft: {why}: stopping at step {step} with a checkpoint", file=sys.stderr)
            break
        all_idx = step_indices(step, len(train_seqs), cfg.batch_size, cfg.seed)
        # stage 1 (plain DFlash) always; with --loop-stages S also one later stage s, loss = (L_1 + L_s) / 2
        stages = [1] + ([loop_stage(cfg.seed, step, cfg.loop_stages)] if cfg.loop_stages > 1 else [])
        plans = []  # per stage: (stage, this rank's anchors, loss scale)
        labels = []
        for st in stages:
            L = stage_len(B, st)
            all_anchors = [sample_anchors(train_seqs[i].loss_mask, L, cfg.anchors,
                                          anchor_generator(cfg.seed, step, i if st == 1 else -(st * len(train_seqs) + i)))
                           for i in all_idx]
            n = torch.tensor(float(sum(len(a) for a in all_anchors)))
            plans.append((st, all_anchors[rank::world], world / max(float(n) * float(w.sum()), 1e-9) / len(stages)))
            if st == 1:
                n_blocks = n
            if frequent is not None:
                labels += [block_labels(train_seqs[i].input_ids[None], a[None], L).flatten() for i, a in
                           zip(all_idx, all_anchors)]
        seqs = [train_seqs[i] for i in all_idx[rank::world]]
        vocab_ids = None
        if frequent is not None:  # the same ids on every rank: labels of the global batch, generator of the step
            vocab_ids = loss_vocabulary(frequent, torch.cat(labels), cfg.loss_vocab // 4, T.vocab_size(model),
                                        anchor_generator(cfg.seed, step, -1))
        opt.zero_grad(set_to_none=True)
        step_num, step_correct = 0.0, []
        for j in range(0, len(seqs), mb):
            inputs = micro_inputs(model, drafter, seqs[j:j + mb], cfg, device, dtype)
            for si, (st, anchors, scale) in enumerate(plans):
                last = j + mb >= len(seqs) and si == len(plans) - 1
                sync = contextlib.nullcontext() if (last or world == 1) else ddp.no_sync()
                with sync:
                    num, correct, _ = micro_loss(ddp, drafter, model, inputs, anchors[j:j + mb], cfg, w, device,
                                                 dtype, vocab_ids, st)
                    (num * scale).backward()
                if st == 1:  # progress lines report stage 1 (plain DFlash), comparable across runs
                    step_num += float(num.detach())
                    step_correct.append(correct.detach().cpu())
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        acc_num += step_num
        acc_blocks += float(n_blocks) / world
        acc_tok += sum(len(s.input_ids) for s in seqs)
        acc_correct.extend(step_correct)
        done = step + 1
        if done % cfg.log_every == 0 or done == last_stop:
            stats = torch.tensor([acc_num, acc_blocks, acc_tok], device=device)
            c = torch.cat(acc_correct)
            cstats = torch.tensor([float(c.long().cumprod(-1).sum()), float(c.sum()), float(c.numel()), float(len(c))],
                                  device=device)
            if world > 1:
                dist.all_reduce(stats)
                dist.all_reduce(cstats)
            dt = time.perf_counter() - t_log
            rate = (done - step_start) / max(time.perf_counter() - t_start, 1e-9)
            row = {"step": done, "loss": float(stats[0]) / max(float(stats[1]), 1) / float(w.sum()),
                   "acc": float(cstats[1] / cstats[2]), "tau": 1 + float(cstats[0] / cstats[3]),
                   "lr": sched.get_last_lr()[0], "tok_s": float(stats[2]) / dt, "blocks_s": float(stats[1]) / dt,
                   "step_s": dt / max(1, done - last_logged)}
            if is_main and (done % cfg.eval_every == 0 or done == last_stop):
                drafter.eval()
                ev = evaluate(drafter, model, eval_seqs, cfg, w, device, dtype)
                if cfg.loop_stages > 1:  # the last stage, predicting from a revealed prefix of (S-1)(B-1)+1 tokens
                    ev.update({f"loop_{k}": v for k, v in
                               evaluate(drafter, model, eval_seqs, cfg, w, device, dtype, cfg.loop_stages).items()
                               if k in ("loss", "acc", "tau")})
                drafter.train()
                row.update({f"eval_{k}": v for k, v in ev.items()})
            eta = (last_stop - done) / rate if rate > 0 else 0.0
            if cfg.time_limit is not None:  # an open-ended run stops at its time limit first
                eta = min(eta, max(0.0, cfg.time_limit * 60 - (time.perf_counter() - t_start)))
            line = (f"step {done}/{cfg.steps} loss {row['loss']:.3f} acc {row['acc']:.3f} τ̂ {row['tau']:.2f}"
                    + (f" | eval loss {row['eval_loss']:.3f} acc {row['eval_acc']:.3f} τ̂ {row['eval_tau']:.2f} "
                       f"acc@k% {' '.join(f'{100 * a:.0f}' for a in row['eval_acc_pos'])}" if "eval_loss" in row else "")
                    + (f" | stage {cfg.loop_stages}: eval loss {row['eval_loop_loss']:.3f} τ̂ {row['eval_loop_tau']:.2f}"
                       if "eval_loop_loss" in row else "")
                    + (f" top-{dc.selector_top_k if dc.arch == 'dflash2' else RECALL_K} recall% "
                       f"{' '.join(f'{100 * a:.0f}' for a in row['eval_topk_recall_pos'])}"
                       if "eval_topk_recall_pos" in row else "")
                    + f" | lr {row['lr']:.2e} | {row['tok_s']:.0f} tok/s {row['blocks_s']:.1f} blocks/s"
                    + f" | eta {eta / 60:.1f} min")
            say(line, file=sys.stderr)
            if is_main:
                with open(metrics_file, "a") as f:
                    f.write(json.dumps(row) + "\n")
            result = row
            acc_num = acc_blocks = acc_tok = 0.0
            acc_correct = []
            t_log, last_logged = time.perf_counter(), done
        cpu_s = cpu_before + (cpu_seconds() - cpu0) * world
        if is_main and dev is not None and dev_every and (done % dev_every == 0 or done == last_stop):
            best = dev_evaluate(drafter, dev, cfg, out, done, cpu_s, best, metrics_file, say)
        if is_main and (done % cfg.save_every == 0 or done == last_stop):
            path = save_checkpoint(out, done, drafter, opt, sched, cfg, n_seqs, cpu_s, best)
            if done == last_stop:
                say(f"flashdraft: saved {path} (use it as --drafter)", file=sys.stderr)
    if is_main and stopped_early and last_stop > start and not (out / f"step_{last_stop:07d}").is_dir():
        save_checkpoint(out, last_stop, drafter, opt, sched, cfg, n_seqs, cpu_before + (cpu_seconds() - cpu0) * world,
                        best)
    if on_term is not None:
        signal.signal(signal.SIGTERM, on_term)
    if world > 1:
        dist.barrier()  # rank 0 may still be writing the last checkpoint
    result["interrupted"] = bool(interrupted)
    result["drafter"] = drafter
    result["final_step"] = last_stop
    return result
