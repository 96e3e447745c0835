"""Engines: what runs a target. `generate`, `bench` and `serve` pick one by name; adding an engine is one module
here with one class, and one line in ENGINES.

An engine class (see Engine) checks decode settings before anything loads, opens a target with a drafter (or plainly,
its own baseline), generates from prompt ids with per-call DecodeSettings, and closes. Its results have output_ids,
text, num_new_tokens, acceptance_lengths, timing.tokens_per_s and to_record(), as decode.GenerationResult does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Protocol

from ..errors import FlashdraftError

if TYPE_CHECKING:
    from ..decoding.settings import DecodeSettings

# name → "module:class", imported on first use so the command line stays light
ENGINES = {
    "torch": "flashdraft.engines.torch:TorchEngine",
    "llamacpp": "flashdraft.engines.llamacpp:LlamaCppEngine",
    "vllm": "flashdraft.engines.vllm:VllmEngine",
    "mlx": "flashdraft.engines.mlx:MlxEngine",
}


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
                 on_tokens: Callable[[list[int]], None] | None = None):
        """One generation; on_tokens gets new tokens as they are accepted."""

    def describe(self, result) -> str:
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


def get_engine(name: str) -> type[Engine]:
    """The engine class registered under name (its module is imported now)."""
    if name not in ENGINES:
        raise FlashdraftError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)
