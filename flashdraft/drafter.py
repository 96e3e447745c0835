"""The DFlash block-diffusion drafter (docs/design.md §2) and its context K/V cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from .config import DrafterConfig, layer_attention
from .dflash2 import CandidateSelector, ShortConv, selector_children
from .packed import is_packed, linear, pack_weight
from .sampling_params import SamplingParams
from .sampling import process, sample

KV = tuple[torch.Tensor, torch.Tensor]  # each [b, kv_heads, n, head_dim]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, n, d]; cos/sin: [b, n, d]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


@dataclass
class ContextCache:
    """Per-layer K/V of the projected target features of committed positions (never block K/V)."""

    kv: list[KV] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.kv[0][0].shape[2] if self.kv else 0

    def extend(self, new: list[KV]) -> list[KV]:
        """Append new positions to every layer; returns the full per-layer K/V."""
        if not self.kv:
            self.kv = list(new)
        else:
            self.kv = [(torch.cat([k, nk], 2), torch.cat([v, nv], 2)) for (k, v), (nk, nv) in zip(self.kv, new)]
        return self.kv

    def crop(self, n: int) -> None:
        self.kv = [(k[:, :, :n], v[:, :, :n]) for k, v in self.kv]


class DrafterAttention(nn.Module):
    """Q from the block; K/V from [context ; block] with shared projections, QK-norm and RoPE."""

    def __init__(self, config: DrafterConfig, layer_idx: int):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """K/V for inputs x [b, n, h] at the positions encoded by cos/sin."""
        k = self.k_norm(self._heads(self.k_proj(x), self.n_kv))
        return apply_rope(k, cos, sin), self._heads(self.v_proj(x), self.n_kv)

    def forward(self, x: torch.Tensor, rope: tuple, ctx: KV, mask: torch.Tensor | None) -> torch.Tensor:
        """x: normed block inputs [b, T, h]; ctx: this layer's context K/V; mask: [b|1, 1, T, n_ctx+T] bool.

        T may hold several blocks that never see each other (training: the mask says so). One masked SDPA over
        context + all blocks: torch's fused CPU kernel never materialises the scores, which measured 1.5-3.8x faster
        (forward + backward) than scoring only context + own block explicitly (64 blocks of 8, 300-1500 context
        positions, float32 and bfloat16).
        """
        cos, sin = rope
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        k = torch.cat([ctx[0].expand(x.shape[0], -1, -1, -1), k_blk], 2)
        v = torch.cat([ctx[1].expand(x.shape[0], -1, -1, -1), v_blk], 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


class DrafterLayer(nn.Module):
    """Pre-norm decoder layer; the context stream enters attention un-normed, as in the reference."""

    def __init__(self, config: DrafterConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DrafterAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config.to_qwen3())
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.arch == "dflash2":
            self.attention_conv, self.mlp_conv = ShortConv(config), ShortConv(config)

    def forward(self, x: torch.Tensor, rope: tuple, ctx: KV, mask: torch.Tensor | None,
                block_size: int) -> torch.Tensor:
        def attn(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn(h, rope, ctx, mask)

        h = self.input_layernorm(x)
        x = x + (self.attention_conv.around(h, attn, block_size) if hasattr(self, "attention_conv") else attn(h))
        h = self.post_attention_layernorm(x)
        return x + (self.mlp_conv.around(h, self.mlp, block_size) if hasattr(self, "mlp_conv") else self.mlp(h))


class DFlashDrafter(nn.Module):
    """Fuses target features into a context stream and denoises a block of [anchor, M, ..., M] in one pass."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DrafterLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config.to_qwen3())
        # DFlash 2 picks its drafts with a candidate-path selector; DFlash 1 takes each position's own choice
        self.candidate_selector = CandidateSelector(config) if config.arch == "dflash2" else None
        # Sorted token ids the drafter may propose (None: all). Not a weight: it lives in draft_vocab.json.
        self.draft_vocab: torch.Tensor | None = None
        self._draft_head: tuple | None = None  # (key, rows of the LM head for draft_vocab, their bias)

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple:
        """positions: [b, n] absolute ids → (cos, sin) [b, n, head_dim] in like's dtype."""
        return self.rotary_emb(like, positions)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """features: [b, n, len(ids)*target_hidden] at absolute positions [b, n] → per-layer K/V."""
        c = self.hidden_norm(self.fc(features))
        rope = self.rope(positions, c)
        return [layer.self_attn.kv(c, *rope) for layer in self.layers]

    def forward(self, block_emb: torch.Tensor, block_pos: torch.Tensor, ctx: list[KV],
                masks: dict[str, torch.Tensor | None] | None = None, block_size: int | None = None) -> torch.Tensor:
        """block_emb: [b, T, h] embedded blocks (T = n_blocks * block_size, default one block) at positions [b, T]
        → final-normed hidden states [b, T, h]."""
        rope = self.rope(block_pos, block_emb)
        masks = masks or {}
        block_size = block_size or block_emb.shape[1]
        scale = self.config.input_embedding_scale
        x = block_emb if scale is None else block_emb * scale
        for layer, kind, layer_ctx in zip(self.layers, self.config.layer_types, ctx):
            x = layer(x, rope, layer_ctx, masks.get(kind), block_size)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the target's LM head (only its rows `vocab_ids` if given), then multiplier and soft-capping."""
        if vocab_ids is None:
            logits = lm_head(hidden.to(lm_head.weight.dtype))
        else:
            bias = None if lm_head.bias is None else lm_head.bias[vocab_ids]
            logits = F.linear(hidden.to(lm_head.weight.dtype), lm_head.weight[vocab_ids], bias)
        return self.scale_logits(logits)

    def draft_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Full-vocabulary logits; with a draft vocabulary only its rows of the head run and the rest are -inf.

        The head is most of a CPU draft (49k rows for SmolLM2); restricting proposals to frequent tokens stays
        lossless: greedy verification never trusts a draft, and at T > 0 q is exactly the distribution sampled.
        """
        if self.draft_vocab is None:
            return self.logits(hidden, lm_head)
        w = lm_head.weight
        key = (w.data_ptr(), w.dtype, w.device, self.draft_vocab.data_ptr())
        if self._draft_head is None or self._draft_head[0] != key:
            ids = self.draft_vocab.to(w.device)
            rows = w[ids].detach().contiguous()  # the target's head is frozen, so its packed rows never go stale
            self._draft_head = (key, pack_weight(rows) if is_packed(lm_head) else rows,
                                None if lm_head.bias is None else lm_head.bias[ids])
        sub = self.scale_logits(linear(hidden.to(w.dtype), self._draft_head[1], self._draft_head[2]))
        full = sub.new_full((*sub.shape[:-1], w.shape[0]), float("-inf"))
        full[..., self.draft_vocab.to(full.device)] = sub
        return full

    def choose_drafts(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int, params: SamplingParams,
                      gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts [n] for the last n block positions (hidden [n, H], logits [n, V]) and the q [n, V] they were drawn
        from (None at temperature 0): DFlash 2 walks its candidate paths from the anchor; DFlash 1 takes each
        position's argmax, or a sample of its processed distribution."""
        if self.candidate_selector is not None:
            return self.candidate_selector.walk(hidden, logits, anchor, 0.0 if params.greedy else params.temperature, gen)
        if params.greedy:
            return logits.argmax(-1), None
        q = process(logits, params)
        return sample(q, gen), q

    def tree_children(self, hidden: torch.Tensor, logits: torch.Tensor,
                      width: int) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """children(depth, parent token) → (log-probabilities, token ids) of a draft tree's best `width` children:
        DFlash 2 rescores each position's candidates by the parent (selector); DFlash 1 ignores the parent."""
        if self.candidate_selector is not None:
            return selector_children(self.candidate_selector, hidden, logits, width)
        lp, ids = torch.log_softmax(logits.float(), -1).topk(min(width, logits.shape[-1]), -1)  # [n, width]
        return lambda d, prev: (lp[d], ids[d])

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """output_multiplier and final_logit_softcapping (DFlash 2 checkpoints), when set."""
        if self.config.output_multiplier is not None:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = cap * torch.tanh(logits / cap)
        return logits


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """Bool [b, 1, T, n]: key at position j is visible from query at position i.

    Causal: j <= i. A window w adds i - j < w and, in a non-causal layer, also j - i < w (the official rule).
    """
    diff = q_pos[..., :, None] - k_pos[..., None, :]  # [b, T, n]
    visible = torch.ones_like(diff, dtype=torch.bool)
    if causal:
        visible &= diff >= 0
    if window is not None:
        visible &= diff < window
        if not causal:
            visible &= -diff < window
    return visible.unsqueeze(1)


def inference_masks(config: DrafterConfig, block_pos: torch.Tensor, n_ctx: int) -> dict[str, torch.Tensor | None]:
    """Per layer kind: None where every context position and the whole block are visible, else the bool mask."""
    k_pos = torch.cat([torch.arange(n_ctx, device=block_pos.device)[None].expand(block_pos.shape[0], -1), block_pos], 1)
    masks: dict[str, torch.Tensor | None] = {}
    for kind in set(config.layer_types):
        causal, window = layer_attention(kind, config.is_causal, config.sliding_window)
        masks[kind] = visible_keys(block_pos, k_pos, causal, window) if causal or window else None
    return masks


def draft_hidden(drafter: DFlashDrafter, cache: ContextCache, new_features: torch.Tensor,
                 block_emb: torch.Tensor, start: int) -> torch.Tensor:
    """Add committed features to the cache and run the drafter on a block starting at position `start`.

    new_features: [1, n_new, F] for positions cache.length..start-1; block_emb: [1, B, h].
    Returns final hidden states [B, h] of all block positions (position 0, the anchor, proposes nothing).
    """
    n_new = new_features.shape[1]
    assert cache.length + n_new == start, (cache.length, n_new, start)
    dev = block_emb.device
    if n_new:
        ctx_pos = torch.arange(cache.length, start, device=dev)[None]
        cache.extend(drafter.context_kv(new_features.to(block_emb.dtype), ctx_pos))
    b = block_emb.shape[1]
    block_pos = torch.arange(start, start + b, device=dev)[None]
    return drafter(block_emb, block_pos, cache.kv, inference_masks(drafter.config, block_pos, start))[0]


def proposal_logits(drafter: DFlashDrafter, hidden: torch.Tensor, lm_head: nn.Module, n: int) -> torch.Tensor:
    """Logits [n, V] proposed by the last n block positions (hidden [L, h]).

    The head runs on n+1 rows (all B rows for a plain block): CPU GEMMs are several times slower for some row
    counts (15 vs 16); the first of those rows proposes nothing.
    """
    return drafter.draft_logits(hidden[-(n + 1):], lm_head)[1:]


def draft_block(drafter: DFlashDrafter, cache: ContextCache, new_features: torch.Tensor,
                block_emb: torch.Tensor, start: int, lm_head: nn.Module) -> torch.Tensor:
    """draft_hidden, then the target's LM head: logits [B-1, V] for block positions 1..B-1."""
    hidden = draft_hidden(drafter, cache, new_features, block_emb, start)
    return proposal_logits(drafter, hidden, lm_head, hidden.shape[0] - 1)


def batch_masks(config: DrafterConfig, block_pos: torch.Tensor, ctx_lens: list[int]) -> dict[str, torch.Tensor]:
    """Per layer kind: bool [N, 1, B, n_max + B] for rows whose contexts hold ctx_lens positions (padded to n_max)."""
    n_max, dev = max(ctx_lens), block_pos.device
    ctx_pos = torch.arange(n_max, device=dev)[None].expand(block_pos.shape[0], -1)
    k_pos = torch.cat([ctx_pos, block_pos], 1)
    real = torch.cat([ctx_pos < torch.tensor(ctx_lens, device=dev)[:, None],
                      torch.ones_like(block_pos, dtype=torch.bool)], 1)  # [N, n_max + B]: padded context slots out
    masks = {}
    for kind in set(config.layer_types):
        causal, window = layer_attention(kind, config.is_causal, config.sliding_window)
        masks[kind] = visible_keys(block_pos, k_pos, causal, window) & real[:, None, None, :]
    return masks


def draft_hidden_batch(drafter: DFlashDrafter, caches: list[ContextCache], new_features: list[torch.Tensor],
                       block_emb: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """draft_hidden for N sequences at once: each cache takes its new features [1, n_i, F], then one drafter pass over
    block_emb [N, B, h] at positions starts[i].. against the contexts padded to one length → hidden [N, B, h]."""
    dev, dtype = block_emb.device, block_emb.dtype
    for cache, feats, start in zip(caches, new_features, starts):
        assert cache.length + feats.shape[1] == start, (cache.length, feats.shape[1], start)
        if feats.shape[1]:
            cache.extend(drafter.context_kv(feats.to(dtype), torch.arange(cache.length, start, device=dev)[None]))
    n_max = max(starts)
    ctx = [tuple(torch.cat([torch.nn.functional.pad(c.kv[layer][j], (0, 0, 0, n_max - c.length)) for c in caches], 0)
                 for j in range(2)) for layer in range(len(drafter.layers))]
    block_pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(block_emb.shape[1], device=dev)
    return drafter(block_emb, block_pos, ctx, batch_masks(drafter.config, block_pos, starts))
