"""TrainConfig: every setting a training run depends on (the `train` flags map 1:1), and its checks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..dtypes import dtype_name
from ..errors import FlashdraftError


@dataclass
class TrainConfig:
    """Everything a training run depends on (CLI flags map 1:1)."""

    data: str | list[str]  # one prepared directory or token store, or several trained on together
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
    data_source: list[str] | None = None  # token stores: train on these sources only (None: all)


def flag(name: str) -> str:
    """The command-line spelling of a setting: batch_size → --batch-size."""
    return "--" + name.replace("_", "-")


def check_config(cfg: TrainConfig, world: int) -> None:
    """One-line FlashdraftErrors for settings that cannot work, before any file is read."""
    check_ranges(cfg)
    if cfg.batch_size % world:
        raise FlashdraftError(f"--batch-size {cfg.batch_size} must be a multiple of the number of processes ({world})")
    if cfg.loss_vocab and cfg.kl_weight > 0:
        raise FlashdraftError("--kl-weight needs the full vocabulary: drop --loss-vocab")
    if cfg.offline and cfg.kl_weight > 0:
        raise FlashdraftError("--kl-weight needs the target's logits: train online (without --offline), or use "
                              "--distill-weight with data prepared with --topk")
    if cfg.distill_weight and not cfg.offline:
        raise FlashdraftError("--distill-weight needs --offline data prepared with --topk K, and must be >= 0")
    if cfg.extend and not cfg.resume:
        raise FlashdraftError("--extend only applies with --resume")
    dtype_name(cfg.dtype)
    dtype_name(cfg.save_dtype)


def check_ranges(cfg: TrainConfig) -> None:
    """Every number in the range where it means something (NaN is in none of them)."""
    for name in ("steps", "batch_size", "anchors", "num_layers", "log_every", "eval_every", "save_every", "loss_chunk",
                 "keep_last", "micro_batch", "stop_after"):  # keep_last 0 would delete the checkpoint just written
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise FlashdraftError(f"{flag(name)} must be >= 1, got {getattr(cfg, name)}")
    if cfg.loop_stages < 1:
        raise FlashdraftError(f"--loop-stages must be >= 1 (1 = plain DFlash), got {cfg.loop_stages}")
    for name, what in (("draft_vocab", "whole vocabulary"), ("loss_vocab", "full vocabulary")):
        if getattr(cfg, name) < 0:
            raise FlashdraftError(f"{flag(name)} must be >= 0 (0 = {what}), got {getattr(cfg, name)}")
    for name in ("warmup_steps", "eval_sequences"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 0:
            raise FlashdraftError(f"{flag(name)} must be >= 0, got {getattr(cfg, name)}")
    finite = math.isfinite
    rules = (("lr", 0 < cfg.lr and finite(cfg.lr), "> 0"),
             ("min_lr_ratio", 0 <= cfg.min_lr_ratio <= 1, "in [0, 1] (the final learning rate as a fraction of --lr)"),
             ("weight_decay", 0 <= cfg.weight_decay and finite(cfg.weight_decay), "a finite number >= 0"),
             ("grad_clip", 0 < cfg.grad_clip, "> 0 (the largest gradient norm kept; inf: no clipping)"),
             ("gamma", cfg.gamma is None or 0 < cfg.gamma, "> 0 (block position k weighs exp(-(k-1)/γ))"),
             ("kl_weight", 0 <= cfg.kl_weight and finite(cfg.kl_weight), "a finite number >= 0"),
             ("distill_weight", 0 <= cfg.distill_weight and finite(cfg.distill_weight), "a finite number >= 0"),
             ("selector_weight", 0 <= cfg.selector_weight and finite(cfg.selector_weight), "a finite number >= 0"),
             ("time_limit", cfg.time_limit is None or 0 < cfg.time_limit, "> 0 minutes"))
    for name, ok, rule in rules:
        if not ok:
            raise FlashdraftError(f"{flag(name)} must be {rule}, got {getattr(cfg, name)}")
    if cfg.dev_samples < 1 or cfg.dev_max_new_tokens < 1 or (cfg.dev_every is not None and cfg.dev_every < 0):
        raise FlashdraftError("--dev-samples and --dev-max-new-tokens must be >= 1 and --dev-every >= 0")
