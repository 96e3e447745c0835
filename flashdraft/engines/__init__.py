"""Engines: what runs a target. `generate`, `bench` and `serve` pick one by name from ENGINES, the one registry: each
entry says where the engine's class is, which bench methods run on it and whether (and how) it serves. Adding an engine
is one module here with one class, and one entry in ENGINES.

An engine class (see Engine) checks decode settings before anything loads, opens a target with a drafter (or plainly,
its own baseline), generates from prompt ids with per-call DecodeSettings, and closes. Every engine's result is a
flashdraft.decoding.GenerationResult: what only one engine measures is in its `extras`, the phases it does not time
apart are None in its timing, and an engine that reports acceptance without cycles gives `reported_acceptance`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from ..errors import FlashdraftError

if TYPE_CHECKING:
    from ..decoding import DecodeSettings, GenerationResult


@dataclass(frozen=True)
class EngineEntry:
    """What `generate`, `bench` and `serve` know of an engine before its module is imported (the command line stays
    light: `--help` and argument errors load no engine)."""

    cls: str  # "module:Class", imported on first use
    plain_method: str  # bench's method for plain decoding on it
    drafter_method: str  # and with a drafter
    serves: str | None = None  # what `flashdraft serve --engine NAME` runs, in words; None: the engine does not serve
    server: str | None = None  # "module:function" that runs that server: function(args, api_key, allowed_hosts) → exit

    @property
    def methods(self) -> tuple[str, str]:
        return self.plain_method, self.drafter_method


ENGINES = {
    "torch": EngineEntry("flashdraft.engines.torch:TorchEngine", "ar", "dflash", "flashdraft's own server",
                         "flashdraft.serve.server:run_server"),
    "llamacpp": EngineEntry("flashdraft.engines.llamacpp:LlamaCppEngine", "llamacpp", "llamacpp-dflash"),
    "vllm": EngineEntry("flashdraft.engines.vllm:VllmEngine", "vllm", "vllm-dflash",
                        "vLLM's server with flashdraft's speculative config", "flashdraft.serve.vllm:run_vllm_server"),
    "mlx": EngineEntry("flashdraft.engines.mlx:MlxEngine", "mlx", "mlx-dflash"),
}
REFERENCE = "torch"  # the engine whose plain method (ar) is bench's reference for every other method


class Engine(Protocol):
    name: str
    interleaves: bool  # whether a drafted and a plain engine can alternate runs (both in this process)
    plain_name: str  # what its plain baseline is called in summaries

    @classmethod
    def check(cls, settings: DecodeSettings, lookup_flag: str | None = None) -> None:
        """One-line errors for settings it cannot honour (lookup_flag: the lookup flag given on the command line)."""

    @classmethod
    def open(cls, target, drafter=None, settings: DecodeSettings | None = None, *, plain: bool = False,
             **options) -> Engine:
        """Ready to decode target with drafter (a directory; None: the target's registered one); plain: without one."""

    def generate(self, prompt_ids: list[int], settings: DecodeSettings,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """One generation; on_tokens gets new tokens as they are accepted."""

    def describe(self, result: GenerationResult) -> str:
        """A result in words, for the summary line."""

    def close(self) -> None: ...

    def __enter__(self) -> Engine: ...

    def __exit__(self, *exc) -> None: ...


def check_chain_engine(settings: DecodeSettings, lookup_flag: str | None, name: str, lookup: bool = False) -> None:
    """One-line errors for what only the torch engine does: DLoop, draft trees (--tree 0, a chain, is fine) and,
    unless the engine has it (lookup=True), prompt lookup; `name` says what the engine does instead."""
    settings.validate()
    if settings.loop_stages != 1:
        raise FlashdraftError("--loop-stages (DLoop) runs on the torch engine only; drop it or use --engine torch")
    if lookup_flag and not lookup:
        raise FlashdraftError(f"{lookup_flag} is for --engine torch ({name} drafts every cycle); drop it")
    if settings.lookup == "tree":
        raise FlashdraftError("--lookup tree grafts onto draft trees, which are torch-only; use --lookup on or off")
    if settings.tree:
        raise FlashdraftError(f"--tree is for --engine torch ({name} verifies a chain); drop it or use --tree 0")


def imported(path: str):
    """The object a "module:name" path names (its module is imported now)."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def get_engine(name: str) -> type[Engine]:
    """The engine class registered under name (its module is imported now)."""
    if name not in ENGINES:
        raise FlashdraftError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    return imported(ENGINES[name].cls)


def check_serves(name: str) -> None:
    """A one-line error unless the engine registered under name serves."""
    if name not in ENGINES or ENGINES[name].serves is None:
        servers = " or ".join(f"{n} ({e.serves})" for n, e in ENGINES.items() if e.serves)
        raise FlashdraftError(f"--engine {name} does not serve: choose {servers}")


def get_server(name: str) -> Callable:
    """The function that runs the server of the engine registered under name (its module is imported now)."""
    check_serves(name)
    return imported(ENGINES[name].server)
