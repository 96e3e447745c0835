"""Drafter training loop (docs/design.md §4): frozen target, block-diffusion drafter, AdamW + warmup/cosine, DDP.

The pieces: batches.py (what a step trains on), step.py (one optimizer step), evaluate.py (held-out and dev τ,
the metrics row and log line), checkpoint.py (save, best, resume), setup.py (processes, device, target).
OUT/metrics.jsonl gets one JSON line per progress row and per dev evaluation; OUT/dev_tau.png plots the dev rows.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .. import target as T
from ..errors import FlashdraftError
from .batches import TrainData, frequent_tokens, training_data
from .build import build_or_load_drafter
from .checkpoint import resume, rewind_metrics, save_best, save_checkpoint, step_dir
from .config import TrainConfig, check_config
from .curve import draw_dev_curve
from .data import data_dirs
from .evaluate import Clock, Meter, append_row, dev_line, dev_row, dev_setup, held_out_row, log_line
from .setup import Models, Runtime, barrier, dist_info, frozen_target, sigterm_flag, start_runtime, wrap_ddp
from .step import make_optimizer, train_step
from .store import check_data, is_store


@dataclass
class TrainResult:
    """How a run ended."""

    metrics: dict  # the last progress row logged (empty when no step ran)
    drafter: nn.Module  # the trained drafter (fp32 weights, on the training device)
    final_step: int  # the step the run stopped at
    interrupted: bool  # SIGTERM arrived


@dataclass
class Run:
    """What the steps of one run share."""

    cfg: TrainConfig
    rt: Runtime
    models: Models
    data: TrainData
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    out: Path
    dev: dict | None
    clock: Clock
    say: Callable[..., None]
    best: dict | None = None  # the dev row of OUT/best
    response_tokens: int | None = 0  # trained on so far, across resumes (None: not counted before a resume)


def train(cfg: TrainConfig, target=None, log=print) -> TrainResult:
    """Train a drafter against a frozen target; `target` may be passed in (tests), else --target is loaded."""
    check_run(cfg)
    rt = start_runtime(cfg.device, cfg.dtype)
    say = log if rt.is_main else quiet
    target = frozen_target(cfg.target, target, rt)
    drafter = build_or_load_drafter(cfg, target).to(rt.device)
    data = training_data(cfg, drafter.config, T.vocab_size(target.model), target.model)
    if cfg.draft_vocab:  # inference only: the loss still covers the whole vocabulary (or --loss-vocab)
        drafter.draft_vocab = frequent_tokens(data.train, cfg.draft_vocab, data.vocab)
    opt, sched = make_optimizer(cfg, drafter)
    out = Path(cfg.out)
    start = resume(cfg, out, drafter, opt, sched, data.n_seqs, say)
    models = Models(target.model, drafter, wrap_ddp(drafter, rt))
    say(banner(cfg, drafter, data, rt), file=sys.stderr)
    if rt.is_main:
        out.mkdir(parents=True, exist_ok=True)
        rewind_metrics(out / "metrics.jsonl", start.step)  # no step twice in metrics.jsonl after a resume
    last_stop = cfg.steps if cfg.stop_after is None else min(cfg.steps, start.step + cfg.stop_after)
    dev = dev_setup(cfg, target, rt.is_main, say)
    run = Run(cfg, rt, models, data, opt, sched, out, dev, Clock(start.cpu_s, rt.world), say, start.best,
              start.response_tokens)
    if dev is not None and start.step == 0:  # the curve's origin: the initial (e.g. --init-from) drafter
        dev_checkpoint(run, 0, start.cpu_s)
    run.clock.start(start.step)
    meter, metrics = Meter(run.clock.t0, start.step), {}
    drafter.train()
    with sigterm_flag() as interrupted:
        for step in range(start.step, last_stop):
            if why := stop_reason(interrupted, cfg.time_limit, run.clock):
                stop_early(run, step, start.step, why)
                last_stop = step
                break
            stats = train_step(cfg, data, step, models, opt, sched, rt)
            meter.add(stats)
            if run.response_tokens is not None:
                run.response_tokens += stats.response_tokens
            done = step + 1
            if done % cfg.log_every == 0 or done == last_stop:
                metrics = log_progress(run, meter, done, last_stop)
            if rt.is_main:
                evaluate_and_save(run, done, last_stop)
    barrier(rt)
    return TrainResult(metrics, drafter, last_stop, bool(interrupted))


def quiet(*args, **kwargs) -> None:
    """The log of ranks other than 0."""


def check_run(cfg: TrainConfig) -> None:
    """The settings, then that every --data is a prepared directory or token store: fail before loading any model."""
    check_config(cfg, dist_info()[1])
    for d in data_dirs(cfg.data):
        check_data(d)
    if cfg.data_source and not any(is_store(d) for d in data_dirs(cfg.data)):
        raise FlashdraftError("--data-source chooses sources of a token store; no --data is one")


def banner(cfg: TrainConfig, drafter: nn.Module, data: TrainData, rt: Runtime) -> str:
    """The first line of a run: what is trained on what, how."""
    drafter_config = drafter.config
    n_params = sum(p.numel() for p in drafter.parameters())
    return (f"flashdraft: training {drafter_config.num_hidden_layers}-layer drafter ({n_params / 1e6:.1f}M params, "
            f"block {drafter_config.block_size}, mask id {drafter_config.mask_token_id}, target layers "
            f"{drafter_config.target_layer_ids}) on {len(data.train)} sequences (+{len(data.held_out)} held out), "
            f"{rt.world} process(es), {cfg.dtype}, {'offline' if cfg.offline else 'online'} features")


def stop_reason(interrupted: list[bool], time_limit: float | None, clock: Clock) -> str | None:
    """Why the run must stop before its next step, if it must."""
    if interrupted:
        return "SIGTERM"
    if time_limit is not None and clock.elapsed() > time_limit * 60:
        return f"--time-limit {time_limit:g} min"
    return None


def log_progress(run: Run, meter: Meter, done: int, last_stop: int) -> dict:
    """The progress row over all ranks (+ held-out evaluation when due), logged and appended to metrics.jsonl."""
    cfg = run.cfg
    row = meter.row(done, run.sched.get_last_lr()[0], run.data.weights, run.rt)
    rate = run.clock.rate(done)
    if run.rt.is_main and (done % cfg.eval_every == 0 or done == last_stop):
        row.update(held_out_row(run.models.drafter, run.models.target, cfg, run.data, run.rt))
    eta = run.clock.eta(done, last_stop, rate, cfg.time_limit)
    run.say(log_line(row, cfg, run.models.drafter.config, eta), file=sys.stderr)
    if run.rt.is_main:
        append_row(run.out / "metrics.jsonl", row)
    meter.restart(done)
    return row


def evaluate_and_save(run: Run, done: int, last_stop: int) -> None:
    """Rank 0 after a step: dev τ, then a checkpoint, when due (both at the run's last step)."""
    cfg = run.cfg
    cpu_s = run.clock.cpu_s()
    dev_every = cfg.save_every if cfg.dev_every is None else cfg.dev_every
    if run.dev is not None and dev_every and (done % dev_every == 0 or done == last_stop):
        dev_checkpoint(run, done, cpu_s)
    if done % cfg.save_every == 0 or done == last_stop:
        path = save(run, done, cpu_s)
        if done == last_stop:
            run.say(f"flashdraft: saved {path} (use it as --drafter)", file=sys.stderr)


def stop_early(run: Run, step: int, start: int, why: str) -> None:
    """Stop before `step` (SIGTERM, --time-limit), keeping a checkpoint of it unless one exists or none ran."""
    run.say(f"flashdraft: {why}: stopping at step {step} with a checkpoint", file=sys.stderr)
    if run.rt.is_main and step > start and not step_dir(run.out, step).is_dir():
        save(run, step, run.clock.cpu_s())


def save(run: Run, step: int, cpu_s: float) -> Path:
    """OUT/step_N of the run now."""
    return save_checkpoint(run.out, step, run.models.drafter, run.opt, run.sched, run.cfg, run.data.n_seqs, cpu_s,
                           run.best, run.response_tokens)


def dev_checkpoint(run: Run, step: int, cpu_s: float) -> None:
    """Measure dev τ, keep OUT/best when it improves, log it and append its row to metrics.jsonl."""
    row = dev_row(run.models.drafter, run.dev, run.cfg, step, cpu_s, run.response_tokens)
    improved = run.best is None or row["dev_tau"] > run.best["dev_tau"]
    if improved:
        save_best(run.out, run.models.drafter, row, run.cfg.save_dtype)
        run.best = row
    run.say(dev_line(row, run.best, improved, run.out / "best"), file=sys.stderr)
    append_row(run.out / "metrics.jsonl", row)
    rows = [json.loads(line) for line in (run.out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    draw_dev_curve(rows, run.out / "dev_tau.png")
