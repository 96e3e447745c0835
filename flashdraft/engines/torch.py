"""flashdraft's own decoding loop (decoding/decoder.py) on a torch target, as an engine."""

from __future__ import annotations

from typing import Callable

import torch

from ..decoding import GenerationResult, generate_ids
from ..decoding.settings import DEFAULTS, DecodeSettings
from ..models import Target, load_drafter_or_plain


class TorchEngine:
    """A loaded target and drafter (None: plain autoregressive decoding) in this process."""

    name = "torch"
    interleaves = True  # both sides of a comparison live in this process: alternate their runs so drift hits both
    plain_name = "autoregressive"

    def __init__(self, target: Target, drafter: torch.nn.Module | None):
        self.target, self.drafter = target, drafter

    @classmethod
    def check(cls, settings: DecodeSettings, lookup_flag: str | None = None) -> None:
        """Every decode setting runs here."""
        settings.validate()

    @classmethod
    def open(cls, target: Target, drafter: str | torch.nn.Module | None = None,
             settings: DecodeSettings | None = None, *, plain: bool = False) -> TorchEngine:
        """drafter: a loaded drafter, or a directory to load (None: the target's registered one; with none at all,
        say so and decode plainly)."""
        if plain or isinstance(drafter, torch.nn.Module):
            return cls(target, None if plain else drafter)
        return cls(target, load_drafter_or_plain(target, drafter, (settings or DEFAULTS).block_size))

    @property
    def block_size(self) -> int | None:
        """The drafter's block size (None without one)."""
        return self.drafter.config.block_size if self.drafter is not None else None

    def resolve(self, settings: DecodeSettings) -> DecodeSettings:
        """settings with the drafter's block size and the target's stop ids where they say None."""
        return settings.resolve(self.block_size, self.target.stop_token_ids())

    def generate(self, prompt_ids: list[int], settings: DecodeSettings,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        result = generate_ids(self.target.model, self.drafter, prompt_ids, self.resolve(settings), on_tokens=on_tokens)
        result.text = self.target.decode(result.output_ids)
        return result

    def describe(self, result: GenerationResult) -> str:
        """The summary line's account of a generation."""
        c, t = result.config, result.timing
        loop = (f", {result.mean_stages:.2f} of up to {c['loop_stages']} drafting stages per cycle at gate "
                f"{c['loop_gate']:g}" if c["loop_stages"] > 1 and c["block_size"] > 1 else "")
        looked = f" ({result.lookup_cycles} by prompt lookup)" if c["lookup"] else ""
        tree = f", tree {c['tree']}" if c["tree"] else ""
        dtype = str(next(self.target.model.parameters()).dtype).removeprefix("torch.")
        return (f"τ {result.tau:.2f} over {len(result.cycles)} cycles{looked}, {t.tokens_per_s:.1f} tok/s "
                f"(block {c['block_size']}{tree}{loop}, {dtype})")

    def close(self) -> None:
        pass  # nothing outside this process to stop

    def __enter__(self) -> TorchEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
