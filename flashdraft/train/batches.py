"""What a step trains on: the usable sequences, the data order, and each step's sequences, anchors and vocabulary.

Determinism: the data order of step s and every sequence's anchors are pure functions of (seed, s, index), so a
run resumed from a checkpoint continues bit-for-bit, and N DDP ranks see exactly the global batch one process
would (rank r takes every N-th sequence; the loss scale uses the global block count).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..config import DrafterConfig
from ..errors import FlashdraftError
from .config import TrainConfig
from .data import Sequence, data_dirs, read_meta
from .loss import loss_vocabulary, position_weights
from .mask import block_labels, eligible_anchors, sample_anchors, stage_len
from .store import is_store, load_data, target_sha256


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


def loop_stage(seed: int, step: int, loop_stages: int) -> int:
    """The later stage trained at `step` (uniform over 2..S, a pure function of seed and step), or 1 without looping."""
    if loop_stages < 2:
        return 1
    return 2 + int(torch.randint(loop_stages - 1, (1,), generator=anchor_generator(seed, step, -2)))


# ---------------------------------------------------------------- the training set

def frequent_tokens(seqs: list[Sequence], n: int, vocab: int) -> torch.Tensor:
    """The n most frequent response-token ids of the training set (ties by id, so deterministic)."""
    counts = torch.bincount(torch.cat([s.input_ids[s.loss_mask.bool()] for s in seqs]), minlength=vocab)
    order = torch.argsort(-counts, stable=True)
    return order[: min(n, int((counts > 0).sum()))].sort().values


def check_feature_layers(cfg: TrainConfig, drafter_config: DrafterConfig) -> None:
    """Offline training needs features stored for exactly the drafter's target layers."""
    want = list(drafter_config.target_layer_ids)
    for d in data_dirs(cfg.data) if cfg.offline else []:
        if is_store(d):
            continue  # load_data says why a store cannot be trained on offline
        stored = read_meta(d).get("feature_layer_ids")
        if stored != want:
            raise FlashdraftError(f"{d} stores features of target layers {stored} but the drafter needs {want}; "
                                  f"re-run prepare --features with --feature-layer-ids {','.join(map(str, want))} "
                                  "or train online")


def prepare_sequences(cfg: TrainConfig, drafter_config: DrafterConfig, vocab: int,
                      target_model=None) -> tuple[list[Sequence], list[Sequence]]:
    """Load the data, keep sequences with at least one whole supervised block, split off the held-out set; token
    stores give the shards the target (when given) generated."""
    where = " + ".join(data_dirs(cfg.data))
    check_feature_layers(cfg, drafter_config)
    stores = target_model is not None and any(is_store(d) for d in data_dirs(cfg.data))
    seqs = load_data(cfg.data, features=cfg.offline, topk=cfg.distill_weight > 0, sources=cfg.data_source,
                     target_sha=target_sha256(target_model) if stores else None)
    top = max(int(s.input_ids.max()) for s in seqs)
    if top >= vocab:
        raise FlashdraftError(f"{where} has token id {top} outside the target vocabulary 0..{vocab - 1}; "
                              "it was prepared with a different target")
    B = drafter_config.block_size
    seqs = [s for s in seqs if len(eligible_anchors(s.loss_mask, B))]
    if len(seqs) < 2:
        raise FlashdraftError(f"{where} has {len(seqs)} sequence(s) with a response of at least {B} tokens; "
                              "need more data or a smaller --block-size")
    tr, ev = split_eval(len(seqs), cfg.eval_sequences, cfg.seed)
    return [seqs[i] for i in tr], [seqs[i] for i in ev]


@dataclass
class TrainData:
    """What every step draws from: the training and held-out sequences, position weights, sampled-softmax base ids."""

    train: list[Sequence]
    held_out: list[Sequence]
    vocab: int  # the target's vocabulary size
    block_size: int
    weights: torch.Tensor  # w_k of block positions 1..B-1
    frequent: torch.Tensor | None  # --loss-vocab: the always-included ids (most frequent tokens + the mask token)

    @property
    def n_seqs(self) -> int:
        return len(self.train) + len(self.held_out)


def training_data(cfg: TrainConfig, drafter_config: DrafterConfig, vocab: int, target_model=None) -> TrainData:
    """The usable sequences of --data, split, with the loss weights and the --loss-vocab base ids."""
    train, held_out = prepare_sequences(cfg, drafter_config, vocab, target_model)
    frequent = None
    if cfg.loss_vocab:  # + the mask token: its own logit starts high (the block input) and must be pushed down
        frequent = torch.cat([frequent_tokens(train, cfg.loss_vocab, vocab),
                              torch.tensor([drafter_config.mask_token_id])]).unique()
    B = drafter_config.block_size
    return TrainData(train, held_out, vocab, B, position_weights(B, cfg.gamma), frequent)


# ---------------------------------------------------------------- one step's batch

@dataclass
class StagePlan:
    """One loop stage of a step: this rank's anchors per sequence and the scale of its loss numerator."""

    stage: int
    anchors: list[torch.Tensor]
    scale: float  # world / (global blocks · Σw) / stages: DDP's gradient average then equals one process's gradient


@dataclass
class StepBatch:
    """This rank's share of one step: sequences, stage plans and the sampled vocabulary (None: full)."""

    seqs: list[Sequence]
    plans: list[StagePlan]
    n_blocks: float  # stage-1 anchor blocks of the global batch
    vocab_ids: torch.Tensor | None
    response_tokens: int  # of the global batch's sequences (the curve's x axis: response tokens trained on)


def step_stages(cfg: TrainConfig, step: int) -> list[int]:
    """Stage 1 (plain DFlash) always; with --loop-stages S also one later stage s, loss = (L_1 + L_s) / 2."""
    return [1] + ([loop_stage(cfg.seed, step, cfg.loop_stages)] if cfg.loop_stages > 1 else [])


def stage_anchors(data: TrainData, idx: list[int], cfg: TrainConfig, step: int, stage: int) -> list[torch.Tensor]:
    """Anchors of every sequence of the global batch at a loop stage (each from its own generator)."""
    L = stage_len(data.block_size, stage)
    n = len(data.train)
    return [sample_anchors(data.train[i].loss_mask, L, cfg.anchors,
                           anchor_generator(cfg.seed, step, i if stage == 1 else -(stage * n + i)))
            for i in idx]


def step_batch(cfg: TrainConfig, data: TrainData, step: int, rank: int, world: int) -> StepBatch:
    """Rank `rank`'s part of step `step`'s global batch; every rank computes the same global counts and ids."""
    idx = step_indices(step, len(data.train), cfg.batch_size, cfg.seed)
    stages = step_stages(cfg, step)
    plans, labels, n_blocks = [], [], 0.0
    for stage in stages:
        anchors = stage_anchors(data, idx, cfg, step, stage)
        n = float(sum(len(a) for a in anchors))
        plans.append(StagePlan(stage, anchors[rank::world],
                               world / max(n * float(data.weights.sum()), 1e-9) / len(stages)))
        n_blocks = n if stage == 1 else n_blocks
        if data.frequent is not None:
            L = stage_len(data.block_size, stage)
            labels += [block_labels(data.train[i].input_ids[None], a[None], L).flatten() for i, a in zip(idx, anchors)]
    vocab_ids = None
    if data.frequent is not None:  # the same ids on every rank: labels of the global batch, generator of the step
        vocab_ids = loss_vocabulary(data.frequent, torch.cat(labels), cfg.loss_vocab // 4, data.vocab,
                                    anchor_generator(cfg.seed, step, -1))
    response_tokens = sum(int(data.train[i].loss_mask.sum()) for i in idx)
    return StepBatch([data.train[i] for i in idx[rank::world]], plans, n_blocks, vocab_ids, response_tokens)
