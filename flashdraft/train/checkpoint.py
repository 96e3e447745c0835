"""Checkpoints of a run: OUT/step_N (a loadable drafter + train_state.pt), OUT/latest, OUT/best, and resuming.

OUT/step_0000100/ holds config.json + model.safetensors (z-lab format, --save-dtype, loadable as --drafter) and
train_state.pt (fp32 weights, optimizer, scheduler, RNG, step, settings); OUT/latest names the newest; OUT/best
is the drafter with the highest dev τ so far. A resumed run continues bit-for-bit.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..atomic import atomic_dir, write_text
from ..checkpoint import save_drafter
from ..errors import FlashdraftError
from .config import TrainConfig

# settings that must not change when resuming (they change the data order, the model or the schedule)
RESUME_KEYS = ("data", "num_layers", "block_size", "mask_token_id", "steps", "batch_size", "lr", "min_lr_ratio",
               "warmup_steps", "weight_decay", "anchors", "gamma", "kl_weight", "seed", "offline", "eval_sequences",
               "loss_vocab", "target_init", "arch", "selector_rank", "selector_top_k", "selector_weight", "loop_stages",
               "distill_weight", "selector_gold", "data_source")
# ... of which --extend lets these change: the data may have grown and the run may be made longer
EXTEND_KEYS = ("data", "steps", "warmup_steps", "data_source")


def step_dir(out: Path, step: int) -> Path:
    return out / f"step_{step:07d}"


def save_checkpoint(out: Path, step: int, drafter: nn.Module, opt, sched, cfg: TrainConfig, n_seqs: int,
                    cpu_s: float = 0.0, best: dict | None = None, response_tokens: int | None = None) -> Path:
    """OUT/step_N: z-lab drafter files + train_state.pt, atomically; then OUT/latest and pruning."""
    path = step_dir(out, step)
    state = {"step": step, "num_sequences": n_seqs, "cpu_s": cpu_s, "best": best, "response_tokens": response_tokens,
             "model": {k: v.detach().cpu().clone() for k, v in drafter.state_dict().items()},
             "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "config": asdict(cfg),
             "rng": {"torch": torch.get_rng_state(),
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}
    with atomic_dir(path) as tmp:
        save_drafter(drafter, tmp, dtype=cfg.save_dtype)
        torch.save(state, tmp / "train_state.pt")
    drafter.config.torch_dtype = "float32"  # save_drafter set it to the saved dtype; the weights stay fp32
    write_text(out / "latest", path.name + "\n")
    prune(out, cfg.keep_last)
    return path


def prune(out: Path, keep_last: int) -> None:
    """Delete all but the newest keep_last step_* directories."""
    steps = sorted(p for p in out.glob("step_*") if p.is_dir() and not p.name.startswith("."))
    for old in steps[: max(0, len(steps) - keep_last)]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint OUT/latest names; None when there is no OUT/latest, an error when it names no checkpoint."""
    f = out / "latest"
    if not f.is_file():
        return None
    name = f.read_text().strip()
    path = out / name
    if not name or not (path / "train_state.pt").is_file():
        raise FlashdraftError(f"{f} names {name or 'nothing'}, which holds no checkpoint (train_state.pt); point it "
                              "at a complete step_* directory of this run to resume from there, or use a new --out")
    return path


def load_state(path: Path, cfg: TrainConfig) -> dict:
    """train_state.pt, checked against the settings that must not change on resume."""
    try:
        state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as e:
        raise FlashdraftError(f"{path}/train_state.pt is unreadable ({e}); resume from an older step_* "
                              "directory") from None
    old = state.get("config", {})
    defaults = TrainConfig(data="", out="")  # keys added after a run started count as their defaults

    def norm(k: str, v):  # num_layers: runs from before it could be None stored the then-default 2
        return (2 if v is None else v) if k == "num_layers" else v

    diff = [k for k in RESUME_KEYS if norm(k, old.get(k, getattr(defaults, k))) != norm(k, getattr(cfg, k))
            and not (cfg.extend and k in EXTEND_KEYS)]
    if cfg.extend and cfg.steps < state["step"]:
        raise FlashdraftError(f"--extend: --steps {cfg.steps} is below the {state['step']} steps already trained")
    if diff:
        changed = ", ".join(f"{k} was {old.get(k)!r} now {getattr(cfg, k)!r}" for k in diff)
        raise FlashdraftError(f"--resume: {changed}; use the original settings or a new --out")
    return state


def restore(state: dict, drafter: nn.Module, opt, sched) -> None:
    """Weights, optimizer, schedule and RNG as they were when the checkpoint was written."""
    drafter.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"].get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])


@dataclass
class ResumePoint:
    """Where a run starts: its first step, the CPU seconds and response tokens already spent, the best dev row."""

    step: int = 0
    cpu_s: float = 0.0
    best: dict | None = None
    response_tokens: int | None = 0  # None: a checkpoint written before they were counted


def check_data_size(state: dict, n_seqs: int, cfg: TrainConfig, say) -> None:
    """The data must be what the run started with, unless --extend accepts that it grew."""
    before = state.get("num_sequences", n_seqs)
    if before == n_seqs:
        return
    if not cfg.extend:
        raise FlashdraftError(f"--resume: --data now has {n_seqs} usable sequences, the run started with {before}; "
                              "resume with the same data or use a new --out")
    say(f"flashdraft: --extend: the data now has {n_seqs} usable sequences (was {before}); "
        "the data order continues over the new set", file=sys.stderr)


def resume(cfg: TrainConfig, out: Path, drafter: nn.Module, opt, sched, n_seqs: int, say) -> ResumePoint:
    """With --resume, restore OUT/latest; without, refuse an OUT that already holds checkpoints."""
    ckpt = latest_checkpoint(out)
    if not cfg.resume:
        if ckpt is not None:
            raise FlashdraftError(f"{out} already holds checkpoints; pass --resume to continue or choose a new --out")
        return ResumePoint(best=read_best(out))
    if ckpt is None:
        say(f"flashdraft: nothing to resume in {out}; starting from step 0", file=sys.stderr)
        return ResumePoint(best=read_best(out))
    state = load_state(ckpt, cfg)
    check_data_size(state, n_seqs, cfg, say)
    restore(state, drafter, opt, sched)
    say(f"flashdraft: resumed from {ckpt} at step {state['step']}", file=sys.stderr)
    # OUT/best may be newer than the checkpoint (a run dies between the two): never replace it by a worse drafter
    return ResumePoint(state["step"], state.get("cpu_s", 0.0), better(state.get("best"), read_best(out)),
                       state.get("response_tokens"))


def read_best(out: Path) -> dict | None:
    """The dev row of OUT/best (best.json), if there is a readable one."""
    try:
        row = json.loads((out / "best" / "best.json").read_text())
    except (OSError, ValueError):
        return None
    return row if isinstance(row, dict) and isinstance(row.get("dev_tau"), (int, float)) else None


def better(a: dict | None, b: dict | None) -> dict | None:
    """The dev row with the higher τ (either when one is missing)."""
    if a is None or b is None:
        return a or b
    return b if b["dev_tau"] > a["dev_tau"] else a


def rewind_metrics(metrics_file: Path, step: int) -> None:
    """Drop the rows a run starting at `step` will write again (and a line torn by a crash), atomically.

    Rows at the checkpoint's own step were written before it was saved; a run from step 0 redoes step 0's dev row.
    """
    if not metrics_file.is_file():
        return
    lines = metrics_file.read_text().splitlines()
    keep = [line for line in lines if (row := parse_row(line)) is not None
            and (row["step"] < step or (step > 0 and row["step"] == step))]
    if len(keep) < len(lines):
        write_text(metrics_file, "".join(line + "\n" for line in keep))


def parse_row(line: str) -> dict | None:
    """A metrics.jsonl row, or None for a line that is not one (torn by a crash mid-append)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def save_best(out: Path, drafter: nn.Module, row: dict, save_dtype: str) -> Path:
    """OUT/best: the drafter with the best dev τ so far, its dev row in best.json."""
    path = out / "best"
    with atomic_dir(path) as tmp:
        save_drafter(drafter, tmp, dtype=save_dtype)
        (tmp / "best.json").write_text(json.dumps(row) + "\n")
    drafter.config.torch_dtype = "float32"
    return path
