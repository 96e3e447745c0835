"""The DFlash drafter (DFlash 1 and 2) in MLX, with weights taken from flashdraft's torch drafter (same checkpoint).

Mirrors drafter.py / dflash2.py: fused target features become a context K/V cache; one pass denoises
[anchor, M, ..., M]; the target's LM head turns the last positions into proposal logits; DFlash 2 adds grouped
dynamic short convolutions around each sublayer and walks its candidate paths. Everything here is lazy: a whole draft
is one graph, evaluated with the verify that follows it.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu
from mlx_lm.models.rope_utils import initialize_rope

from ..config import DrafterConfig, layer_attention
from ..sampling_params import SamplingParams
from .sampling import mlx_process, mlx_sample

MlxKV = tuple[mx.array, mx.array]  # each [1, kv_heads, n, head_dim]


class Attention(nn.Module):
    """Q from the block; K/V from [context ; block] with shared projections, QK-norm and RoPE."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=c.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=c.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=c.attention_bias)
        self.q_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.rope = initialize_rope(d, c.rope_theta, False, c.rope_scaling, c.max_position_embeddings)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        return x.reshape(*x.shape[:2], n, self.head_dim).transpose(0, 2, 1, 3)

    def kv(self, x: mx.array, offset: int) -> MlxKV:
        """K/V for inputs x [1, n, h] at positions offset.."""
        k = self.rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv)), offset=offset)
        return k, self._heads(self.v_proj(x), self.n_kv)

    def __call__(self, x: mx.array, offset: int, ctx: MlxKV, mask: mx.array | None) -> mx.array:
        q = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=offset)
        k_blk, v_blk = self.kv(x, offset)
        k, v = mx.concatenate([ctx[0], k_blk], 2), mx.concatenate([ctx[1], v_blk], 2)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(*x.shape[:2], -1))


class MLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def mlx_grouped_conv(x: mx.array, base: mx.array, delta: mx.array) -> mx.array:
    """out_t = Σ_o (base[o] + δ_t[o] per channel group) · x_{t-o} within one block; x [1, T, H], base [K, H],
    delta [1, T, K, H/G]."""
    T, H = x.shape[1], x.shape[2]
    out = mx.zeros_like(x)
    for o in range(base.shape[0]):
        shifted = mx.pad(x, [(0, 0), (o, 0), (0, 0)])[:, :T]  # position t sees t - o (zeros before the block)
        w = base[o] + mx.repeat(delta[:, :, o], H // delta.shape[-1], axis=-1)
        out = out + w * shifted
    return out


class MlxShortConv(nn.Module):
    """DFlash 2: a learned base kernel plus a per-position, per-channel-group correction from the normed input."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.kernel, self.groups = c.conv_kernel_size, c.hidden_size // c.conv_group_size
        self.base_kernel = mx.zeros((2, self.kernel, c.hidden_size))
        self.kernel_projection = nn.Linear(c.hidden_size, 2 * self.kernel * self.groups, bias=False)

    def around(self, h: mx.array, sublayer) -> mx.array:
        delta = self.kernel_projection(h).reshape(*h.shape[:2], 2, self.kernel, self.groups)
        y = sublayer(mlx_grouped_conv(h, self.base_kernel[0], delta[:, :, 0]))
        return mlx_grouped_conv(y, self.base_kernel[1], delta[:, :, 1])


class Layer(nn.Module):
    """Pre-norm decoder layer; the context stream enters attention un-normed, as in the reference."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.convs = c.arch == "dflash2"
        if self.convs:
            self.attention_conv, self.mlp_conv = MlxShortConv(c), MlxShortConv(c)

    def __call__(self, x: mx.array, offset: int, ctx: MlxKV, mask: mx.array | None) -> mx.array:
        def attn(h: mx.array) -> mx.array:
            return self.self_attn(h, offset, ctx, mask)

        h = self.input_layernorm(x)
        x = x + (self.attention_conv.around(h, attn) if self.convs else attn(h))
        h = self.post_attention_layernorm(x)
        return x + (self.mlp_conv.around(h, self.mlp) if self.convs else self.mlp(h))


class MlxCandidateSelector(nn.Module):
    """DFlash 2: S_t(a, b) = U_t(b) + ⟨pred[a] ⊙ W h_t, succ[b]⟩ over each position's top-k candidates."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.top_k = c.selector_top_k
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)
        self.predecessor_codebook = mx.zeros((c.vocab_size, c.selector_rank))
        self.successor_codebook = mx.zeros((c.vocab_size, c.selector_rank))

    def walk(self, hidden: mx.array, logits: mx.array, anchor: int, temperature: float,
             key: mx.array | None) -> tuple[mx.array, mx.array | None]:
        """Left-to-right path: hidden [n, H], logits [n, V] → drafts [n], q [n, V] or None (greedy); lazy throughout
        (each step's predecessor stays on the device)."""
        n, V = logits.shape
        k = min(self.top_k, V)
        cand = mx.argpartition(-logits, k - 1, axis=-1)[:, :k]
        scores = mx.take_along_axis(logits, cand, -1)
        order = mx.argsort(-scores, -1)  # torch.topk's order: best first
        cand, scores = mx.take_along_axis(cand, order, -1), mx.take_along_axis(scores, order, -1)
        proj = self.hidden_projection(hidden.astype(mx.float32))  # [n, r]
        keys = mx.random.split(key, n) if key is not None else [None] * n
        prev, drafts, qs = mx.array(anchor), [], []
        for t in range(n):
            s = scores[t] + (self.successor_codebook[cand[t]] @ (self.predecessor_codebook[prev] * proj[t]))  # [k]
            if temperature == 0:
                j = mx.argmax(s)
            else:
                probs = mx.softmax(s / temperature, -1)
                j = mx.random.categorical(mx.log(probs), key=keys[t])
                qs.append(mx.zeros((V,), dtype=mx.float32).at[cand[t]].add(probs))
            prev = cand[t, j]
            drafts.append(prev)
        return mx.stack(drafts), mx.stack(qs) if qs else None


class MlxDrafter(nn.Module):
    """The DFlash drafter in MLX: context_kv for committed features, forward for a block."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        self.layers = [Layer(c) for _ in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.fc = nn.Linear(len(c.target_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if c.arch == "dflash2":
            self.candidate_selector = MlxCandidateSelector(c)
        self.draft_vocab: mx.array | None = None  # sorted ids the drafter may propose (None: all)
        self._draft_head: tuple | None = None  # (the head weight, its draft_vocab rows transposed), gathered once

    def context_kv(self, features: mx.array, offset: int) -> list[MlxKV]:
        """features [1, n, len(ids)·target_hidden] at positions offset.. → per-layer K/V."""
        c = self.hidden_norm(self.fc(features))
        return [layer.self_attn.kv(c, offset) for layer in self.layers]

    def __call__(self, block_emb: mx.array, start: int, ctx: list[MlxKV]) -> mx.array:
        """block_emb [1, B, h] at positions start.. → final-normed hidden [1, B, h]."""
        scale = self.config.input_embedding_scale
        x = block_emb if scale is None else block_emb * scale
        masks = mlx_inference_masks(self.config, start, block_emb.shape[1])
        for layer, kind, layer_ctx in zip(self.layers, self.config.layer_types, ctx):
            x = layer(x, start, layer_ctx, masks[kind])
        return self.norm(x)

    def scale_logits(self, logits: mx.array) -> mx.array:
        c = self.config
        if c.output_multiplier is not None:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping:
            logits = c.final_logit_softcapping * mx.tanh(logits / c.final_logit_softcapping)
        return logits

    def draft_logits(self, hidden: mx.array, head_weight: mx.array) -> mx.array:
        """hidden [n, h] → float32 logits [n, V] through the target's head; with a draft vocabulary only its rows run
        and the rest are -inf (drafter.py: lossless, the verify never trusts a draft)."""
        h = hidden.astype(head_weight.dtype)
        if self.draft_vocab is None:
            return self.scale_logits((h @ head_weight.T).astype(mx.float32))
        if self._draft_head is None or self._draft_head[0] is not head_weight:  # the target's head is frozen
            rows = head_weight[self.draft_vocab].T
            mx.eval(rows)
            self._draft_head = (head_weight, rows)
        sub = self.scale_logits((h @ self._draft_head[1]).astype(mx.float32))
        full = mx.full((h.shape[0], head_weight.shape[0]), -mx.inf, dtype=mx.float32)
        full[:, self.draft_vocab] = sub
        return full

    def choose_drafts(self, hidden: mx.array, logits: mx.array, anchor: int, params: SamplingParams,
                      key: mx.array | None) -> tuple[mx.array, mx.array | None]:
        """drafter.py's choose_drafts: drafts [n] and the q [n, V] they were drawn from (None at temperature 0)."""
        if self.config.arch == "dflash2":
            return self.candidate_selector.walk(hidden, logits, anchor, 0.0 if params.greedy else params.temperature,
                                                key)
        if params.greedy:
            return mx.argmax(logits, -1), None
        q = mlx_process(logits, params)
        return mlx_sample(q, key), q


def mlx_inference_masks(c: DrafterConfig, start: int, b: int) -> dict[str, mx.array | None]:
    """Per layer kind: None where the whole context and block are visible, else a bool mask [1, 1, b, start + b]
    (drafter.py's visible_keys)."""
    diff = (start + mx.arange(b))[:, None] - mx.arange(start + b)[None]
    masks: dict[str, mx.array | None] = {}
    for kind in set(c.layer_types):
        causal, window = layer_attention(kind, c.is_causal, c.sliding_window)
        visible = mx.ones(diff.shape, dtype=mx.bool_)
        if causal:
            visible = visible & (diff >= 0)
        if window is not None:
            visible = visible & (diff < window) & ((-diff < window) | causal)
        masks[kind] = visible[None, None] if causal or window else None
    return masks


class MlxContextCache:
    """Per-layer K/V of the projected target features of committed positions."""

    def __init__(self):
        self.kv: list[MlxKV] = []

    @property
    def length(self) -> int:
        return self.kv[0][0].shape[2] if self.kv else 0

    def extend(self, new: list[MlxKV]) -> list[MlxKV]:
        self.kv = list(new) if not self.kv else [(mx.concatenate([k, nk], 2), mx.concatenate([v, nv], 2))
                                                 for (k, v), (nk, nv) in zip(self.kv, new)]
        return self.kv


def draft(drafter: MlxDrafter, cache: MlxContextCache, new_features: mx.array | None, block_emb: mx.array, start: int,
          head_weight: mx.array, n: int) -> tuple[mx.array, mx.array]:
    """Committed features into the cache, one pass over block_emb [1, B, h] at start.. → (hidden [n, h],
    logits [n, V]) of the last n block positions (the head runs on n + 1 rows, as drafter.py's proposal_logits)."""
    if new_features is not None and new_features.shape[0]:
        cache.extend(drafter.context_kv(new_features[None].astype(block_emb.dtype), cache.length))
    if cache.length != start:
        raise RuntimeError(f"drafter context holds {cache.length} positions, expected {start}")
    hidden = drafter(block_emb, start, cache.kv)[0]
    return hidden[-n:], drafter.draft_logits(hidden[-(n + 1):], head_weight)[1:]


def from_torch(drafter, dtype: mx.Dtype = mx.float32) -> MlxDrafter:
    """An MlxDrafter with the weights of flashdraft's torch drafter (state_dict names are the same)."""
    state = drafter.state_dict()
    out = MlxDrafter(drafter.config)
    names = [k for k, _ in nn.utils.tree_flatten(out.parameters())]
    missing = [k for k in names if k not in state]
    if missing:
        raise RuntimeError(f"the torch drafter has no weights for {missing[:5]}")
    out.load_weights([(k, mx.array(state[k].detach().float().cpu().numpy()).astype(dtype)) for k in names])
    if drafter.draft_vocab is not None:
        out.draft_vocab = mx.array(np.asarray(drafter.draft_vocab.cpu(), dtype=np.int64).astype(np.int32))
    mx.eval(out.parameters())
    return out
