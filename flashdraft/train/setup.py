"""Where a run executes: processes (torchrun), device and dtype, the frozen target, DDP, SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import parse_dtype
from ..models import load_target


@dataclass
class Runtime:
    """This process's place in the run: rank of world (torchrun), device and compute dtype."""

    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class Models:
    """The networks of a run."""

    target: nn.Module  # the frozen target (its Hugging Face model)
    drafter: nn.Module  # the drafter being trained, fp32 master weights
    ddp: nn.Module  # what the training forward calls: the drafter, or its DDP wrapper


def dist_info() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def pick_device(name: str | None, local_rank: int) -> torch.device:
    """--device, else this rank's GPU, else the CPU."""
    if name:
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def start_runtime(device: str | None, dtype: str) -> Runtime:
    """Join torchrun's process group (if any) and select this rank's device."""
    rank, world, local_rank = dist_info()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    dev = pick_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return Runtime(rank, world, dev, parse_dtype(dtype))


def frozen_target(name: str | None, target, rt: Runtime):
    """The target (loaded from --target unless given) in eval mode without gradients."""
    if target is None:
        target = load_target(name, dtype=rt.dtype, device=str(rt.device))
    target.model.eval()
    for p in target.model.parameters():
        p.requires_grad_(False)
    return target


def wrap_ddp(drafter: nn.Module, rt: Runtime) -> nn.Module:
    """The drafter in DistributedDataParallel under torchrun, else itself."""
    if rt.world == 1:
        return drafter
    device_ids = [rt.device.index] if rt.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(drafter, device_ids=device_ids)


def barrier(rt: Runtime) -> None:
    """Wait for every rank (rank 0 may still be writing the last checkpoint)."""
    if rt.world > 1:
        dist.barrier()


@contextlib.contextmanager
def sigterm_flag() -> Iterator[list[bool]]:
    """A list that gets an entry when SIGTERM arrives; the previous handler comes back afterwards.

    SIGTERM is what `kill` and schedulers send (background jobs ignore SIGINT); the run then ends with a checkpoint.
    Only the main thread may set handlers, so elsewhere (a test's worker thread) the flag never rises.
    """
    flag: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: flag.append(True))
    try:
        yield flag
    finally:
        signal.signal(signal.SIGTERM, previous)
