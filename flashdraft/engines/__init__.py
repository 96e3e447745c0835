"""Engines: what runs a target. `generate`, `bench` and `serve` pick one by name; adding an engine is one module
here with one class, and one line in ENGINES.

An engine class offers:
    check(settings, lookup_flag=None)   one-line errors for decode settings it cannot honour, before anything loads
    open(target, drafter=None, settings=DEFAULTS, *, plain=False, **options) -> engine
                                        ready to decode the target with that drafter (None: the target's registered
                                        one; plain: none at all, the engine's own baseline)
    engine.generate(prompt_ids, settings, on_tokens=None) -> result
                                        output_ids, text, acceptance_lengths, to_record() (GenerationResult-shaped)
    engine.close()                      engines are context managers too
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
}


class Engine(Protocol):
    name: str

    @classmethod
    def check(cls, settings: DecodeSettings, lookup_flag: str | None = None) -> None: ...

    @classmethod
    def open(cls, target, drafter=None, settings: DecodeSettings | None = None, *, plain: bool = False,
             **options) -> Engine: ...

    def generate(self, prompt_ids: list[int], settings: DecodeSettings,
                 on_tokens: Callable[[list[int]], None] | None = None): ...

    def close(self) -> None: ...

    def __enter__(self) -> Engine: ...

    def __exit__(self, *exc) -> None: ...


def get_engine(name: str) -> type[Engine]:
    """The engine class registered under name (its module is imported now)."""
    if name not in ENGINES:
        raise FlashdraftError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)
