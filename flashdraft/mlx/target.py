"""The target as an mlx-lm model loaded from the same Hugging Face directory: forward with captured features, caches
that roll back by trimming."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import load_model

from ..dtypes import DTYPE_NAMES
from ..errors import FlashdraftError

MLX_DTYPES = {name: getattr(mx, name) for name in DTYPE_NAMES}


class Capture(nn.Module):
    """A decoder layer that keeps its output (HF's hidden_states[i + 1]) in `slot.out` (the official model_mlx.py)."""

    def __init__(self, layer: nn.Module, slot: SimpleNamespace):
        super().__init__()
        self.layer, self.slot = layer, slot

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "layer" or "layer" not in self:
                raise
            return getattr(self["layer"], name)  # attributes the model reads, e.g. use_sliding

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        y = self.layer(x, *args, **kwargs)
        self.slot.out = y
        return y


def rope_overrides(config: dict) -> dict:
    """transformers 5 writes RoPE as `rope_parameters`, which mlx-lm does not read (it would silently use θ = 10000):
    pass θ (and any scaling) the old way."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" in config:
        return {}
    out = {"rope_theta": params["rope_theta"]} if "rope_theta" in params else {}
    if params.get("rope_type", "default") != "default":
        out["rope_scaling"] = params
    return out


@dataclass
class MlxTarget:
    """An mlx-lm model with its decoder layers, embedding and head at hand."""

    model: nn.Module
    slots: dict[int, SimpleNamespace]  # captured layers → their last output: only the layers a drafter reads

    @property
    def inner(self) -> nn.Module:
        return self.model.model

    def capture(self, layer_ids: list[int]) -> None:
        """Keep the outputs of these decoder layers (HF hidden_states[i + 1]) from now on. Only these: each kept
        output holds a whole forward's activations of its layer until the next forward."""
        layers = self.inner.layers
        missing = [i for i in layer_ids if not 0 <= i < len(layers)]
        if missing:
            raise FlashdraftError(f"the drafter reads target layers {missing}; the target has {len(layers)}")
        for i in layer_ids:
            if i not in self.slots:
                self.slots[i] = SimpleNamespace(out=None)
                layers[i] = Capture(layers[i], self.slots[i])

    def embed(self, ids: mx.array) -> mx.array:
        return self.inner.embed_tokens(ids)

    def head_weight(self) -> mx.array:
        """The LM head's weight [V, h] (the embedding when they are tied)."""
        lm_head = getattr(self.model, "lm_head", None)
        return (lm_head if lm_head is not None else self.inner.embed_tokens).weight

    def head(self, h: mx.array) -> mx.array:
        lm_head = getattr(self.model, "lm_head", None)
        return lm_head(h) if lm_head is not None else self.inner.embed_tokens.as_linear(h)

    def new_cache(self) -> list:
        return make_prompt_cache(self.model)

    def forward(self, ids: list[int] | mx.array, cache: list, layer_ids: list[int],
                keep: int = 0) -> tuple[mx.array, mx.array | None]:
        """ids [n] after the cached positions → (float32 logits [n or keep, V], features [n, len(layer_ids)·h] or
        None); lazy: nothing is evaluated here."""
        self.capture(layer_ids)
        x = mx.array(ids) if isinstance(ids, list) else ids
        h = self.inner(x[None], cache)[0]  # final-normed hidden [n, h]
        logits = self.head(h[-keep:] if keep else h).astype(mx.float32)
        feats = mx.concatenate([self.slots[i].out[0] for i in layer_ids], -1) if layer_ids else None
        return logits, feats


def trim(cache: list, n: int) -> None:
    """Drop the last n cached positions (rejected drafts)."""
    if n > 0 and trim_prompt_cache(cache, n) != n:
        raise FlashdraftError(f"the mlx-lm cache could not drop {n} rejected positions (a cache that stops being "
                              "trimmable mid-generation); use --engine torch")


def untrimmable(cache: list) -> list[str]:
    """The kinds of cache layers that cannot roll back rejected drafts: those mlx-lm cannot trim, and sliding-window
    (rotating) ones, which can only until their window fills."""
    if can_trim_prompt_cache(cache) and not any(hasattr(c, "max_size") for c in cache):
        return []
    return sorted({type(c).__name__ for c in cache if not c.is_trimmable() or hasattr(c, "max_size")})


def cache_length(cache: list) -> int:
    return cache[0].offset


@functools.cache
def load_mlx_target(path: str | Path, dtype: str) -> MlxTarget:
    """The mlx-lm model in `path` (a Hugging Face directory) in `dtype`; loaded once per process and shared by plain
    and drafted engines, each layer a drafter reads captured on first use (`MlxTarget.capture`). A target whose cache
    mlx-lm cannot trim is refused: speculative decoding rolls back rejected drafts."""
    path = Path(path)
    if not (path / "config.json").is_file():
        from huggingface_hub import snapshot_download  # a hub id: the snapshot transformers already downloaded

        try:
            path = Path(snapshot_download(str(path), local_files_only=True))
        except (ValueError, OSError):  # not a valid hub id, or not in the local cache
            raise FlashdraftError(f"the mlx engine needs {path} as a local Hugging Face directory (config.json and "
                                  "*.safetensors); download it first or pass its folder as --target") from None
    config = json.loads((path / "config.json").read_text())
    try:
        model, _ = load_model(path, model_config=rope_overrides(config))
    except (ValueError, FileNotFoundError) as e:
        raise FlashdraftError(f"mlx-lm cannot load {path}: {e}") from None
    kinds = untrimmable(make_prompt_cache(model))
    if kinds:
        raise FlashdraftError(f"the mlx engine cannot decode {path.name}: mlx-lm cannot roll back its "
                              f"{', '.join(kinds)} cache layers, which rejected drafts need; use --engine torch")
    model.set_dtype(MLX_DTYPES[dtype])
    mx.eval(model.parameters())
    return MlxTarget(model, {})
