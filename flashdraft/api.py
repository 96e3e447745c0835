"""The Python entry point: text or ids in, tokens + text + stats out."""

from __future__ import annotations

from typing import Callable

import torch

from .decoding import DecodeSettings, GenerationResult, decode_batch, generate_ids, settings_from
from .models import Target


def generate(target: Target, drafter: torch.nn.Module | None, prompt: str | list[int],
             settings: DecodeSettings | None = None, *, chat: bool = True,
             on_tokens: Callable[[list[int]], None] | None = None, **overrides) -> GenerationResult:
    """Speculative decoding of a prompt (text gets the chat template unless chat=False; a list is raw ids).

    drafter=None means plain autoregressive decoding. settings: a DecodeSettings (decoding/settings.py: block size,
    length, sampling, stop ids, prompt lookup, trees, DLoop); keyword overrides use its field names, e.g.
    generate(target, drafter, "Hi", max_new_tokens=64, temperature=0.7). Stops at the target's EOS ids by default.
    """
    ids = list(prompt) if isinstance(prompt, list) else target.encode(prompt, chat=chat)
    s = settings_from(settings, **overrides)
    if s.stop_token_ids is None:
        s = s.updated(stop_token_ids=target.stop_token_ids())
    result = generate_ids(target.model, drafter, ids, s, on_tokens=on_tokens)
    result.text = target.decode(result.output_ids)
    return result


def generate_batch(target: Target, drafter: torch.nn.Module | None, prompts: list[str | list[int]],
                   settings: DecodeSettings | list[DecodeSettings] | None = None, *, chat: bool = True,
                   adaptive: bool = True, max_batch: int | None = None, **overrides) -> list[GenerationResult]:
    """Several prompts decoded together (decoding/decoder.py): one result per prompt, in order, each with the output
    generate would give it alone. settings: one for all or one per prompt; adaptive (default): each cycle's
    speculation follows measured costs and each request's acceptance (docs/adaptive.md); max_batch: sequences at once."""
    ids = [list(p) if isinstance(p, list) else target.encode(p, chat=chat) for p in prompts]
    per = settings if isinstance(settings, list) else [settings] * len(ids)
    stops = target.stop_token_ids()
    per = [settings_from(s, **overrides) for s in per]
    per = [s if s.stop_token_ids is not None else s.updated(stop_token_ids=stops) for s in per]
    results = decode_batch(target.model, drafter, ids, per, adaptive=adaptive, max_batch=max_batch)
    for r in results:
        r.text = target.decode(r.output_ids)
    return results
