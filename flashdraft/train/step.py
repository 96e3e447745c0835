"""One optimizer step: AdamW with warmup + cosine, this rank's micro-batches, backward, clip, update."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from .batches import TrainData, step_batch
from .config import TrainConfig
from .forward import micro_inputs, micro_loss
from .setup import Models, Runtime


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))


def make_optimizer(cfg: TrainConfig, drafter: nn.Module):
    """AdamW (no weight decay on norms and biases) and its warmup + cosine schedule; fills in cfg.warmup_steps."""
    if cfg.warmup_steps is None:
        cfg.warmup_steps = max(1, int(0.04 * cfg.steps))  # stored in checkpoints as the value actually used
    decay = [p for p in drafter.parameters() if p.dim() >= 2]
    no_decay = [p for p in drafter.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95),
                            eps=1e-8, foreach=False)
    schedule = functools.partial(lr_factor, warmup=cfg.warmup_steps, total=cfg.steps, min_ratio=cfg.min_lr_ratio)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


@dataclass
class StepStats:
    """Stage-1 (plain DFlash) figures of one step on this rank, for the progress line."""

    num: float  # loss numerator
    blocks: float  # global anchor blocks / world, so that the all-reduced sum is the global count
    tokens: int
    correct: list[torch.Tensor]  # per micro-batch, bool [M, B-1]
    response_tokens: int  # of the global batch


def train_step(cfg: TrainConfig, data: TrainData, step: int, models: Models, opt, sched, rt: Runtime) -> StepStats:
    """Accumulate this rank's gradient over its micro-batches (DDP syncs on the last backward only), then update."""
    batch = step_batch(cfg, data, step, rt.rank, rt.world)
    mb = cfg.micro_batch or cfg.batch_size // rt.world
    opt.zero_grad(set_to_none=True)
    num, correct = 0.0, []
    for j in range(0, len(batch.seqs), mb):
        inputs = micro_inputs(models.target, models.drafter, batch.seqs[j:j + mb], cfg, rt.device, rt.dtype)
        for si, plan in enumerate(batch.plans):
            last = j + mb >= len(batch.seqs) and si == len(batch.plans) - 1
            with contextlib.nullcontext() if last or rt.world == 1 else models.ddp.no_sync():
                n, c, _ = micro_loss(models.ddp, models.drafter, models.target, inputs, plan.anchors[j:j + mb], cfg,
                                     data.weights, rt.device, rt.dtype, batch.vocab_ids, plan.stage)
                (n * plan.scale).backward()
            if plan.stage == 1:  # progress lines report stage 1 (plain DFlash), comparable across runs
                num += float(n.detach())
                correct.append(c.detach().cpu())
    torch.nn.utils.clip_grad_norm_(models.drafter.parameters(), cfg.grad_clip)
    opt.step()
    sched.step()
    return StepStats(num, batch.n_blocks / rt.world, sum(len(s.input_ids) for s in batch.seqs), correct,
                     batch.response_tokens)
