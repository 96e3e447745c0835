"""Target adapter over Hugging Face causal LMs: forward with features, cache rollback, embedding and head."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from .errors import FlashdraftError


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [n_keep, V] float32
    features: torch.Tensor  # [n, len(layer_ids) * hidden]


def num_layers(model: PreTrainedModel) -> int:
    return model.config.get_text_config().num_hidden_layers


def hidden_size(model: PreTrainedModel) -> int:
    return model.config.get_text_config().hidden_size


def vocab_size(model: PreTrainedModel) -> int:
    return model.get_output_embeddings().weight.shape[0]


def context_limit(model: PreTrainedModel) -> int:
    return getattr(model.config.get_text_config(), "max_position_embeddings", None) or 1 << 30


def embed(model: PreTrainedModel) -> nn.Module:
    return model.get_input_embeddings()


def lm_head(model: PreTrainedModel) -> nn.Module:
    return model.get_output_embeddings()


def final_norm(model: PreTrainedModel) -> nn.Module | None:
    """The target's last norm before the LM head, when the model exposes one as `model.norm`."""
    return getattr(getattr(model, "model", None), "norm", None)


def new_cache(model: PreTrainedModel) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()  # sliding-window / linear layers must be able to roll back
    return cache


def forward(model: PreTrainedModel, ids: torch.Tensor, start: int, cache: DynamicCache,
            layer_ids: list[int], logits_to_keep: int = 0) -> TargetOutput:
    """Run ids [n] at positions start..start+n-1 on top of cache; features are hidden_states[i + 1] for i in layer_ids.

    logits_to_keep=0 keeps all n positions' logits, k>0 only the last k.
    """
    if cache.get_seq_length() != start:
        raise RuntimeError(f"target cache holds {cache.get_seq_length()} positions, expected {start}")
    pos = torch.arange(start, start + ids.shape[0], device=ids.device)[None]
    out = model(input_ids=ids[None], position_ids=pos, use_cache=True, output_hidden_states=bool(layer_ids),
                logits_to_keep=logits_to_keep, **{cache_kwarg(model): cache})
    feats = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], -1) if layer_ids else ids.new_zeros(0)
    return TargetOutput(out.logits[0].float(), feats)


@functools.cache
def _cache_kwarg(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_kwarg(model: PreTrainedModel) -> str:
    """Newer transformers name the forward argument `cache`, older ones `past_key_values`."""
    return _cache_kwarg(type(model))


def rollback_to(cache: DynamicCache, n: int) -> None:
    """Drop every cached position >= n (rejected drafts)."""
    extra = cache.get_seq_length() - n
    if extra < 0:
        raise RuntimeError(f"cannot roll back to {n}: the cache only holds {cache.get_seq_length()} positions")
    if extra:
        cache.crop(-extra)  # a negative count removes that many trailing positions (all transformers versions)


def check_prompt(model: PreTrainedModel, ids: list[int]) -> None:
    """One-line errors for prompts the target cannot take."""
    if not ids:
        raise FlashdraftError("the prompt is empty; give some text or --prompt-ids")
    v = vocab_size(model)
    bad = [i for i in ids if not 0 <= i < v]
    if bad:
        raise FlashdraftError(f"prompt token ids {bad[:5]} are outside the target vocabulary 0..{v - 1}")
    limit = context_limit(model)
    if len(ids) >= limit:
        raise FlashdraftError(f"the prompt has {len(ids)} tokens but the target's context is {limit}; "
                              "shorten the prompt so at least one new token fits")
