"""sampling.py's `process` and `sample` in MLX, for the drafter's q inside a cycle (acceptance itself is shared)."""

from __future__ import annotations

import mlx.core as mx

from ..sampling_params import SamplingParams


def mlx_process(logits: mx.array, params: SamplingParams) -> mx.array:
    """logits [..., V] → float32 probabilities after temperature, top-k, then top-p (as sampling.process)."""
    logits = logits.astype(mx.float32) / params.temperature
    V = logits.shape[-1]
    if params.top_k and params.top_k < V:
        kth = mx.sort(logits, -1)[..., V - params.top_k: V - params.top_k + 1]
        logits = mx.where(logits < kth, -mx.inf, logits)
    probs = mx.softmax(logits, -1)
    if params.top_p < 1:
        order = mx.argsort(-probs, -1)
        sorted_p = mx.take_along_axis(probs, order, -1)
        drop_sorted = (mx.cumsum(sorted_p, -1) - sorted_p) >= params.top_p  # the top token is always kept
        drop = mx.put_along_axis(mx.zeros_like(drop_sorted), order, drop_sorted, -1)
        probs = mx.where(drop, 0.0, probs)
        probs = probs / probs.sum(-1, keepdims=True)
    return probs


def mlx_sample(probs: mx.array, key: mx.array | None) -> mx.array:
    """probs [..., V] → token ids [...]."""
    return mx.random.categorical(mx.log(probs), axis=-1, key=key)
