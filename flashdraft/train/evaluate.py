"""How a run is measured: held-out loss and τ̂, real dev τ by speculative decoding, the metrics row and log line."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..config import DrafterConfig
from ..decoding import DecodeSettings, generate_ids, mean_acceptance
from ..errors import FlashdraftError
from ..models import load_target
from .batches import TrainData, anchor_generator
from .config import TrainConfig
from .data import Sequence, interleave, read_jsonl_prompts
from .forward import RECALL_K, micro_inputs, micro_loss
from .loss import mean_loss, position_accuracy, tau_hat
from .mask import sample_anchors, stage_len
from .setup import Runtime
from .step import StepStats
from .store import dev_files


# ---------------------------------------------------------------- held-out sequences

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


def held_out_row(drafter: nn.Module, target: nn.Module, cfg: TrainConfig, data: TrainData, rt: Runtime) -> dict:
    """The eval_* columns of a metrics row: stage 1 and, with --loop-stages S, the last stage's loss, acc and τ̂."""
    drafter.eval()
    ev = evaluate(drafter, target, data.held_out, cfg, data.weights, rt.device, rt.dtype)
    if cfg.loop_stages > 1:  # the last stage, predicting from a revealed prefix of (S-1)(B-1)+1 tokens
        last = evaluate(drafter, target, data.held_out, cfg, data.weights, rt.device, rt.dtype, cfg.loop_stages)
        ev.update({f"loop_{k}": v for k, v in last.items() if k in ("loss", "acc", "tau")})
    drafter.train()
    return {f"eval_{k}": v for k, v in ev.items()}


# ---------------------------------------------------------------- progress rows

def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads): the compute a run has cost."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass
class Clock:
    """CPU time since the run (re)started plus earlier runs', and wall time since its first step."""

    cpu_before: float  # CPU seconds of the runs before a resume
    world: int
    cpu0: float = field(default_factory=cpu_seconds)
    t0: float = 0.0
    step0: int = 0

    def start(self, step: int) -> None:
        """Wall time, rates and --time-limit count from here (the first step of this run)."""
        self.t0, self.step0 = time.perf_counter(), step

    def cpu_s(self) -> float:
        """CPU seconds of the whole run so far, every rank counted (ranks are assumed alike)."""
        return self.cpu_before + (cpu_seconds() - self.cpu0) * self.world

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def rate(self, done: int) -> float:
        """Steps per second of this run so far."""
        return (done - self.step0) / max(self.elapsed(), 1e-9)

    def eta(self, done: int, last_stop: int, rate: float, time_limit: float | None) -> float:
        """Seconds until this run ends: at `rate`, or at its time limit if that comes first."""
        eta = (last_stop - done) / rate if rate > 0 else 0.0
        if time_limit is not None:
            eta = min(eta, max(0.0, time_limit * 60 - self.elapsed()))
        return eta


@dataclass
class Meter:
    """Stage-1 figures summed over the steps since the last progress row."""

    t_log: float
    last_logged: int
    num: float = 0.0
    blocks: float = 0.0
    tokens: float = 0.0
    correct: list[torch.Tensor] = field(default_factory=list)

    def add(self, s: StepStats) -> None:
        self.num += s.num
        self.blocks += s.blocks
        self.tokens += s.tokens
        self.correct.extend(s.correct)

    def row(self, done: int, lr: float, w: torch.Tensor, rt: Runtime) -> dict:
        """The progress columns over all ranks (an all-reduce under torchrun); then starts summing afresh."""
        stats = torch.tensor([self.num, self.blocks, self.tokens], device=rt.device)
        c = torch.cat(self.correct)
        cstats = torch.tensor([float(c.long().cumprod(-1).sum()), float(c.sum()), float(c.numel()), float(len(c))],
                              device=rt.device)
        if rt.world > 1:
            dist.all_reduce(stats)
            dist.all_reduce(cstats)
        dt = time.perf_counter() - self.t_log
        row = {"step": done, "loss": float(stats[0]) / max(float(stats[1]), 1) / float(w.sum()),
               "acc": float(cstats[1] / cstats[2]), "tau": 1 + float(cstats[0] / cstats[3]),
               "lr": lr, "tok_s": float(stats[2]) / dt, "blocks_s": float(stats[1]) / dt,
               "step_s": dt / max(1, done - self.last_logged)}
        self.num = self.blocks = self.tokens = 0.0
        self.correct = []
        return row

    def restart(self, done: int) -> None:
        """Rates of the next row count from now (after this row's evaluation and logging)."""
        self.t_log, self.last_logged = time.perf_counter(), done


def percents(values: list[float]) -> str:
    return " ".join(f"{100 * a:.0f}" for a in values)


def log_line(row: dict, cfg: TrainConfig, drafter_config: DrafterConfig, eta: float) -> str:
    """The progress line of a metrics row (held-out parts only when the row has them)."""
    line = f"step {row['step']}/{cfg.steps} loss {row['loss']:.3f} acc {row['acc']:.3f} τ̂ {row['tau']:.2f}"
    if "eval_loss" in row:
        line += (f" | eval loss {row['eval_loss']:.3f} acc {row['eval_acc']:.3f} τ̂ {row['eval_tau']:.2f} "
                 f"acc@k% {percents(row['eval_acc_pos'])}")
    if "eval_loop_loss" in row:
        line += f" | stage {cfg.loop_stages}: eval loss {row['eval_loop_loss']:.3f} τ̂ {row['eval_loop_tau']:.2f}"
    if "eval_topk_recall_pos" in row:
        k = drafter_config.selector_top_k if drafter_config.arch == "dflash2" else RECALL_K
        line += f" top-{k} recall% {percents(row['eval_topk_recall_pos'])}"
    return (line + f" | lr {row['lr']:.2e} | {row['tok_s']:.0f} tok/s {row['blocks_s']:.1f} blocks/s"
            f" | eta {eta / 60:.1f} min")


def append_row(metrics_file: Path, row: dict) -> None:
    """One JSON line in OUT/metrics.jsonl."""
    with open(metrics_file, "a") as f:
        f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------- dev τ: real speculative decoding

def dev_setup(cfg: TrainConfig, target, is_main: bool, say) -> dict | None:
    """The dev prompts (--dev-prompts, else every DATA/dev.jsonl, interleaved so each source counts) as ids and a
    float32 target to decode them with."""
    if not is_main or cfg.dev_every == 0:
        return None
    if cfg.dev_prompts and not Path(cfg.dev_prompts).is_file():
        raise FlashdraftError(f"--dev-prompts {cfg.dev_prompts} does not exist")
    paths = [Path(cfg.dev_prompts)] if cfg.dev_prompts else dev_files(cfg.data, cfg.data_source)
    if not paths:
        return None
    prompts = interleave([read_jsonl_prompts(p) for p in paths])[: cfg.dev_samples]
    where = " + ".join(map(str, paths))
    dev_target = target
    if next(target.model.parameters()).dtype != torch.float32:  # τ is measured as it will be served: float32
        dev_target = load_target(cfg.target, dtype="float32", device=str(next(target.model.parameters()).device))
    say(f"flashdraft: dev τ on {len(prompts)} prompts of {where}, {cfg.dev_max_new_tokens} new tokens, float32",
        file=sys.stderr)
    return {"target": dev_target, "ids": [dev_target.encode(p) for p in prompts]}


@torch.no_grad()
def dev_tau(drafter: nn.Module, dev: dict, max_new_tokens: int) -> tuple[float, int]:
    """Pooled τ of real greedy speculative decoding over the dev prompts (decoded as `generate` would): (τ, cycles)."""
    target = dev["target"]
    settings = DecodeSettings(max_new_tokens=max_new_tokens, stop_token_ids=tuple(target.stop_token_ids()))
    lengths = [n for ids in dev["ids"] for n in generate_ids(target.model, drafter, ids, settings).acceptance_lengths]
    return (mean_acceptance(lengths) if lengths else float("nan")), len(lengths)


def dev_row(drafter: nn.Module, dev: dict, cfg: TrainConfig, step: int, cpu_s: float,
            response_tokens: int | None = None) -> dict:
    """A dev metrics row: τ at `step` with the CPU-hours and (when counted) response tokens trained on so far."""
    was_training = drafter.training
    drafter.eval()
    t0 = time.perf_counter()
    tau, cycles = dev_tau(drafter, dev, cfg.dev_max_new_tokens)
    drafter.train(was_training)
    row = {"step": step, "dev_tau": tau, "dev_cycles": cycles, "cpu_hours": cpu_s / 3600,
           "dev_s": time.perf_counter() - t0}
    return row if response_tokens is None else {**row, "response_tokens": response_tokens}


def dev_line(row: dict, best: dict, improved: bool, best_dir: Path) -> str:
    """The log line of a dev evaluation."""
    note = f"new best → {best_dir}" if improved else f"best {best['dev_tau']:.3f} at step {best['step']}"
    return (f"step {row['step']} | dev τ {row['dev_tau']:.3f} over {row['dev_cycles']} cycles ({row['dev_s']:.0f} s) "
            f"| {row['cpu_hours']:.2f} CPU-h{tokens_note(row)} | {note}")


def tokens_note(row: dict) -> str:
    """', 1.23M response tokens' when the row counts them."""
    n = row.get("response_tokens")
    return "" if n is None else f", {n / 1e6:.2f}M response tokens"
