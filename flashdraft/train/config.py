"""TrainConfig: every setting a training run depends on (the `train` flags map 1:1), and its checks."""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint import parse_dtype
from ..errors import FlashdraftError


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


def flag(name: str) -> str:
    """The command-line spelling of a setting: batch_size → --batch-size."""
    return "--" + name.replace("_", "-")


def check_config(cfg: TrainConfig, world: int) -> None:
    """One-line FlashdraftErrors for settings that cannot work, before any file is read."""
    for name in ("steps", "batch_size", "anchors", "num_layers", "log_every", "eval_every", "save_every", "loss_chunk",
                 "keep_last"):  # keep_last 0 would delete the checkpoint just written
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise FlashdraftError(f"{flag(name)} must be >= 1, got {getattr(cfg, name)}")
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
