"""Straightforward references for the official DFlash rules, written with explicit loops and no caches.

They reuse the drafter's weights (projections, norms, RoPE tables) but none of flashdraft's masking, caching,
convolution, selector or decode-loop code, so tests can hold that code against them.
"""

from __future__ import annotations

import math

import torch
from transformers.models.qwen3.modeling_qwen3 import rotate_half

SLIDING = "sliding_attention"


def sees(q: int, k: int, kind: str, is_causal: bool | None, window: int | None) -> bool:
    """The rule as the issue states it, for one (query position, key position) pair."""
    causal = is_causal if is_causal is not None else kind == SLIDING
    if causal and k > q:
        return False
    if kind == SLIDING and q - k >= window:
        return False
    if kind == SLIDING and not causal and k - q >= window:
        return False
    return True


def conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, group: int) -> torch.Tensor:
    """out[t, c] = Σ_o (base[o, c] + delta[t, o, c // group]) · x[t - o, c], taps before the block start are zero."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for o in range(base.shape[0]):
            if t - o >= 0:
                out[t] += (base[o] + delta[t, o].repeat_interleave(group)) * x[t - o]
    return out


def attention(attn, h: torch.Tensor, c: torch.Tensor, block_pos: list[int], kind: str, is_causal: bool | None,
              window: int | None, rope) -> torch.Tensor:
    """Drafter attention: queries from the block h [B, H], keys/values from [c ; h]; one query, one head at a time."""
    d, n_heads, n_kv = attn.head_dim, attn.n_heads, attn.n_kv
    k_pos = list(range(c.shape[0])) + block_pos
    xs = torch.cat([c, h])
    cos, sin = rope(xs[None], torch.tensor([k_pos]))
    cos, sin = cos[0], sin[0]

    def heads(x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], n, d).transpose(0, 1)  # [n, len, d]

    q = attn.q_norm(heads(attn.q_proj(h), n_heads))
    q = q * cos[-len(block_pos):] + rotate_half(q) * sin[-len(block_pos):]
    k = attn.k_norm(heads(attn.k_proj(xs), n_kv))
    k = k * cos + rotate_half(k) * sin
    v = heads(attn.v_proj(xs), n_kv)
    out = torch.zeros(len(block_pos), n_heads, d)
    for i, qp in enumerate(block_pos):
        keys = [j for j, kp in enumerate(k_pos) if sees(qp, kp, kind, is_causal, window)]
        for hd in range(n_heads):
            kv = hd // (n_heads // n_kv)
            w = torch.softmax(torch.stack([q[hd, i] @ k[kv, j] for j in keys]) / math.sqrt(d), 0)
            out[i, hd] = sum(wj * v[kv, j] for wj, j in zip(w, keys))
    return attn.o_proj(out.reshape(len(block_pos), -1))


@torch.no_grad()
def drafter_hidden(drafter, feats: torch.Tensor, block_emb: torch.Tensor, start: int) -> torch.Tensor:
    """Final hidden states [B, H] of the block at positions start.. over context features feats [start, F]."""
    cfg = drafter.config
    is_causal = getattr(cfg, "is_causal", None)  # absent: the default rule
    c = drafter.hidden_norm(drafter.fc(feats))
    pos = list(range(start, start + block_emb.shape[0]))
    x = block_emb * (getattr(cfg, "input_embedding_scale", None) or 1.0)  # dflash_config.input_embedding_scale
    for layer, kind in zip(drafter.layers, cfg.layer_types):
        window = cfg.sliding_window if kind == SLIDING else None

        def attn(h: torch.Tensor) -> torch.Tensor:
            return attention(layer.self_attn, h, c, pos, kind, is_causal, window, drafter.rotary_emb)

        for norm, sub, conv_mod in [(layer.input_layernorm, attn, getattr(layer, "attention_conv", None)),
                                    (layer.post_attention_layernorm, layer.mlp, getattr(layer, "mlp_conv", None))]:
            h = norm(x)
            if conv_mod is None:
                x = x + sub(h)
                continue
            k, g = conv_mod.base_kernel.shape[1], cfg.conv_group_size
            delta = conv_mod.kernel_projection(h).view(h.shape[0], 2, k, -1)
            y = sub(conv(h, conv_mod.base_kernel[0], delta[:, 0], g))
            x = x + conv(y, conv_mod.base_kernel[1], delta[:, 1], g)
    return drafter.norm(x)


@torch.no_grad()
def selector_path(selector, hidden: torch.Tensor, logits: torch.Tensor, anchor: int) -> list[int]:
    """Greedy candidate path: at each position the top-k candidate b maximising U(b) + <pred[prev] * W h, succ[b]>."""
    path, prev = [], anchor
    for t in range(logits.shape[0]):
        cand = logits[t].topk(selector.top_k).indices.tolist()
        proj = selector.hidden_projection(hidden[t])
        score = [float(logits[t, b] + (selector.predecessor_codebook[prev] * proj) @ selector.successor_codebook[b])
                 for b in cand]
        prev = cand[max(range(len(cand)), key=score.__getitem__)]
        path.append(prev)
    return path


@torch.no_grad()
def official_greedy(target, drafter, prompt: list[int], block_size: int, max_new_tokens: int
                    ) -> tuple[list[int], list[list[int]]]:
    """The official generation loop at T=0, recomputed from scratch every cycle: (new tokens, verified blocks).

    max_length = prompt + max_new_tokens; while start + 1 < max_length: verify_size = min(block_size,
    max_length - start), draft [anchor, M, ...] of that size, keep the matching prefix and the target's token,
    emit at most max_length - start - 1 tokens.
    """
    cfg, embed, head = drafter.config, target.get_input_embeddings(), target.get_output_embeddings()
    ids = list(prompt) + [int(target(torch.tensor([prompt])).logits[0, -1].argmax())]
    start, max_length, blocks = len(prompt), len(prompt) + max_new_tokens, []
    while start + 1 < max_length:
        size = min(block_size, max_length - start)
        block = [ids[start]]
        if size > 1:
            out = target(torch.tensor([ids[:start]]), output_hidden_states=True)
            feats = torch.cat([out.hidden_states[i + 1][0] for i in cfg.target_layer_ids], -1)
            emb = embed(torch.tensor(block + [cfg.mask_token_id] * (size - 1)))
            hidden = drafter_hidden(drafter, feats, emb, start)[1:]
            logits = drafter.logits(hidden, head)
            selector = getattr(drafter, "candidate_selector", None)
            block += (selector_path(selector, hidden, logits, block[0]) if selector is not None
                      else logits.argmax(-1).tolist())
        posterior = target(torch.tensor([ids[:start] + block])).logits[0, start:].argmax(-1).tolist()
        accepted = next((k for k in range(size - 1) if block[k + 1] != posterior[k]), size - 1)
        produced = min(accepted + 1, max_length - start - 1)
        ids = ids[:start + 1] + (block[1:accepted + 1] + [posterior[accepted]])[:produced]
        start += produced
        blocks.append(block)
    return ids[len(prompt):], blocks
