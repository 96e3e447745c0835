"""The Python entry point: text or ids in, tokens + text + stats out."""

from __future__ import annotations

from typing import Callable

import torch

from .decode import GenerationResult, generate_ids
from .models import Target


def generate(target: Target, drafter: torch.nn.Module | None, prompt: str | list[int], *, chat: bool = True,
             block_size: int | None = None, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, stop_token_ids: list[int] | None = None,
             on_tokens: Callable[[list[int]], None] | None = None, loop_stages: int = 1,
             loop_gate: float = -0.75, lookup: bool | str = True, tree: int | None = None) -> GenerationResult:
    """Speculative decoding of a prompt (text gets the chat template unless chat=False; a list is raw ids).

    drafter=None means plain autoregressive decoding (block size 1). Stops at the target's EOS ids by default.
    loop_stages > 1 enables DLoop: up to that many drafting stages per cycle while the drafter's summed draft
    log-probability of the last stage exceeds loop_gate; the target verifies them all in one pass (still lossless).
    lookup (default on) verifies the tokens that followed an earlier occurrence of the text's last n-gram instead of
    drafting, wherever one recurs (prompt lookup); lossless too. lookup="tree": at temperature 0, verify them as one
    more path of the drafter's tree instead (higher τ, more verify rows).
    tree: at temperature 0, draft-tree nodes verified per drafter cycle (default 7; 0 = the drafter's chain).
    """
    ids = list(prompt) if isinstance(prompt, list) else target.encode(prompt, chat=chat)
    stops = target.stop_token_ids() if stop_token_ids is None else stop_token_ids
    result = generate_ids(target.model, drafter, ids, block_size=block_size, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop_token_ids=stops,
                          on_tokens=on_tokens, loop_stages=loop_stages, loop_gate=loop_gate, lookup=lookup,
                          tree=tree)
    result.text = target.decode(result.output_ids)
    return result
