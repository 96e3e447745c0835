"""Target adapter over Hugging Face causal LMs: forward with features, cache rollback, embedding and head."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from . import lean, packed
from .errors import FlashdraftError
from .tree import node_depths


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


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer over a buffer that doubles when full.

    HF's DynamicLayer re-concatenates the whole cache on every forward (11% of a CPU decode step at 1,500
    positions); here new positions are written in place and a rollback only moves the end.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.end = 0  # positions held; the buffers may be longer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]  # views of [b, h, capacity, d]
        self.is_initialized = True

    def _grow(self, need: int) -> None:
        cap = max(256, need, 2 * self.keys.shape[-2])
        for name in ("keys", "values"):
            old = getattr(self, name)
            buf = old.new_empty(*old.shape[:-2], cap, old.shape[-1])
            buf[..., : self.end, :] = old[..., : self.end, :]
            setattr(self, name, buf)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self.end + n > self.keys.shape[-2]:
            self._grow(self.end + n)
        self.keys[..., self.end:self.end + n, :] = key_states
        self.values[..., self.end:self.end + n, :] = value_states
        self.end += n
        return self.keys[..., : self.end, :], self.values[..., : self.end, :]

    def get_seq_length(self) -> int:
        return self.end

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        self.end = max(0, self.end + tokens_to_remove)


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache for one sequence that can roll back; full-attention layers grow in place (GrowingLayer)."""
    cache = DynamicCache(config=model.config)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()  # sliding-window / linear layers must be able to roll back
    if len(cache.layers) == num_layers(model) and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def sdpa_gqa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """HF's SDPA attention, but grouped-query K/V stay grouped under a mask as well.

    HF expands K/V to every query head when a mask is given (any block verify), copying each layer's whole cache;
    torch's CPU kernel takes the grouped heads directly (enable_gqa) and gives the same result.
    """
    if getattr(module, "num_key_value_groups", 1) == 1 or attention_mask is None or kwargs.get("position_bias") \
            is not None or kwargs.get("softcap") is not None or module.training:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


SDPA_GQA = "grouped_sdpa"  # no "flash" in the name: transformers reads that as flash attention
AttentionInterface.register(SDPA_GQA, sdpa_gqa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_GQA, sdpa_mask)


def use_lean(model: PreTrainedModel) -> bool:
    """Route a frozen target's decode forwards through lean.py when it supports the architecture; returns whether."""
    model.flashdraft_lean = lean.lean_model(model, pack=packed.is_packed(model))
    return model.flashdraft_lean is not None


def use_grouped_sdpa(model: PreTrainedModel) -> bool:
    """On CPU, switch a model that runs HF's SDPA attention to sdpa_gqa_attention; returns whether it did."""
    if model.device.type != "cpu" or model.config._attn_implementation != "sdpa":
        return False
    model.config._attn_implementation = SDPA_GQA  # set_attn_implementation would look the name up on the kernel hub
    return True


def ancestors(parents: list[int]) -> torch.Tensor:
    """[N+1, N+1] bool: row i sees column j when j is i or an ancestor of i; row/column 0 is the anchor."""
    n = len(parents) + 1
    see = torch.eye(n, dtype=torch.bool)
    see[:, 0] = True
    for i, p in enumerate(parents, start=1):
        if p >= 0:
            see[i] |= see[p + 1]
    return see


def block_visibility(parents: list[int] | None, n: int) -> torch.Tensor:
    """[n, n] bool: which of a block's rows each row sees (a chain: causal; a tree: itself and its ancestors)."""
    if parents is None:
        return torch.ones(n, n, dtype=torch.bool).tril()
    return ancestors(parents)


def tree_mask(parents: list[int], start: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive attention mask [1, 1, N+1, start+N+1] for the anchor and the nodes on top of `start` cached positions."""
    see = torch.cat([torch.ones(len(parents) + 1, start, dtype=torch.bool), ancestors(parents)], 1)
    mask = torch.zeros(see.shape, dtype=dtype).masked_fill(~see, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def forward(model: PreTrainedModel, ids: torch.Tensor, start: int, cache: DynamicCache,
            layer_ids: list[int], logits_to_keep: int = 0, parents: list[int] | None = None) -> TargetOutput:
    """Run ids [n] at positions start..start+n-1 on top of cache; features are hidden_states[i + 1] for i in layer_ids.

    logits_to_keep=0 keeps all n positions' logits, k>0 only the last k. With parents (tree.py), ids are an anchor and
    a draft tree: row i+1 sits at position start + its depth and sees the context and its own ancestors only.
    """
    if cache.get_seq_length() != start:
        raise RuntimeError(f"target cache holds {cache.get_seq_length()} positions, expected {start}")
    n = ids.shape[0]
    if parents is None:
        pos = torch.arange(start, start + n, device=ids.device)[None]
    else:
        pos = torch.tensor([0] + node_depths(parents), device=ids.device)[None] + start
    lm = lean.current(model) if not torch.is_grad_enabled() else None
    if lm is not None and lean.ragged(lm, n):  # no mask: the kernel reads this row's positions and block as they are
        rows = (torch.tensor([start]), block_visibility(parents, n)[None])
        logits, feats = lean.lean_forward(lm, ids[None], pos, cache, None, layer_ids, logits_to_keep, rows)
        return TargetOutput(logits[0], feats[0] if feats is not None else ids.new_zeros(0))
    extra = {} if parents is None else {"attention_mask": tree_mask(parents, start, model.dtype, ids.device)}
    if lm is not None:
        logits, feats = lean.lean_forward(lm, ids[None], pos, cache, extra.get("attention_mask"), layer_ids,
                                          logits_to_keep)
        return TargetOutput(logits[0], feats[0] if feats is not None else ids.new_zeros(0))
    out = model(input_ids=ids[None], position_ids=pos, use_cache=True, output_hidden_states=bool(layer_ids),
                logits_to_keep=logits_to_keep, **extra, **{cache_kwarg(model): cache})
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


def supports_tree(cache: DynamicCache) -> bool:
    """Whether keep_rows can compact this cache: every layer a full-attention GrowingLayer."""
    return all(type(layer) is GrowingLayer for layer in cache.layers)


def keep_rows(cache: DynamicCache, start: int, rows: list[int]) -> None:
    """Keep the verified block's rows `rows` (relative to start, increasing) as positions start.. and drop the rest."""
    if rows == list(range(len(rows))):
        return rollback_to(cache, start + len(rows))
    idx = torch.tensor(rows) + start
    for layer in cache.layers:
        for buf in (layer.keys, layer.values):
            buf[..., start:start + len(rows), :] = buf[..., idx.to(buf.device), :]  # the gather copies first
        layer.end = start + len(rows)


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
