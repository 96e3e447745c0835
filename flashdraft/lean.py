"""A lean forward for Llama-family targets (Llama, Qwen2, Qwen3, Mistral without a window): the decode hot path.

A decode step of a small target on a CPU is a few hundred small matmuls plus glue; Hugging Face's forward adds
mask building, output recording and per-module dispatch around them. This runs the same arithmetic straight off the
model's own weights: q/k/v and gate/up fused into one (packed) matmul each, RoPE from the model's rotary module, the
K/V written through the cache layer's own `update` (so GrowingLayer / RaggedLayer rollback and compaction are
untouched), attention by grouped-query SDPA under the caller's mask or, for plain decode steps with the native
kernels, by the ragged kernel over each row's own positions, and features taken as they pass. Every elementwise step
repeats transformers' order of operations (RMSNorm in float32, rotate_half RoPE), so outputs equal the HF forward's
up to the matmul blocking and, where the native kernels run the norms, their sum order (tests/test_lean.py holds
logits and features to float32 tolerance and greedy tokens equal).
Targets it does not know run through Hugging Face (`lean_model` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from . import kernels, packed

LEAN_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class LeanLayer:
    """One decoder layer's weights: fused projections (packed on CPU where supported) and norms."""

    qkv: torch.Tensor  # [(heads + 2·kv_heads)·head_dim, H]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [H, heads·head_dim]
    gate_up: torch.Tensor  # [2·I, H]
    down: torch.Tensor  # [H, I]
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None  # Qwen3's per-head RMSNorm
    k_norm: torch.Tensor | None


@dataclass
class LeanModel:
    """What the lean forward needs of a target, built once at load time (weights shared, fused copies owned)."""

    layers: list[LeanLayer]
    embed: torch.nn.Module
    rotary: torch.nn.Module
    norm: torch.Tensor
    head: torch.Tensor  # [V, H]
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    pack: bool
    fused: bool  # norms and SiLU·up through flashdraft's fused CPU ops (packed float32 with the kernels built)
    ragged_kernel: bool  # decode widths attend through csrc/attention.cpp (float32 or bfloat16 on CPU, kernels built,
    # head dim a multiple of 16)
    params: list[torch.nn.Parameter]  # the source weights (walking the module tree per forward costs ms); a
    # Parameter replaced by a new object is not seen: call target.use_lean again after such surgery
    stamp: tuple  # their storage and version when the fused copies were taken


def stamp(params: list[torch.nn.Parameter]) -> tuple:
    """Changes when any weight is replaced (`.to(dtype)`, a load) or edited in place (its version counter)."""
    return tuple((p.data_ptr(), 0 if p.is_inference() else p._version) for p in params)


def current(model: PreTrainedModel) -> LeanModel | None:
    """The model's lean view (set up by target.use_lean), rebuilt if its weights changed since it was taken."""
    lm = getattr(model, "flashdraft_lean", None)
    if lm is not None and lm.stamp != stamp(lm.params):
        lm = model.flashdraft_lean = lean_model(model, lm.pack)
    return lm


def supported(model: PreTrainedModel) -> bool:
    """Whether the lean forward computes exactly what this target's HF forward does."""
    cfg = model.config  # the model's own type: a multimodal wrapper around a Llama text model is not this layout
    if cfg.model_type not in LEAN_TYPES or getattr(model, "lm_head", None) is None \
            or not hasattr(getattr(model, "model", None), "layers"):
        return False
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", cfg.model_type == "mistral"):
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        return False
    if cfg.model_type == "qwen2":  # q/k/v biases, which the fused projection carries
        return True
    return not getattr(cfg, "attention_bias", False)


def lean_model(model: PreTrainedModel, pack: bool = False) -> LeanModel | None:
    """The lean view of a loaded, frozen target, or None when `supported` says no; pack: oneDNN-pack the fused
    weights where packed.packable allows (as pack_linears does for the HF modules)."""
    if not supported(model):
        return None

    def _weight(w: torch.Tensor) -> torch.Tensor:
        w = w.detach().contiguous()
        return packed.pack_weight(w) if pack and packed.packable(w.device, w.dtype) else w

    cfg = model.config.get_text_config()
    params = list(model.parameters())
    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        bias = None
        if a.q_proj.bias is not None:
            bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach()
        layers.append(LeanLayer(
            qkv=_weight(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])), qkv_bias=bias,
            o=_weight(a.o_proj.weight), gate_up=_weight(torch.cat([m.gate_proj.weight, m.up_proj.weight])),
            down=_weight(m.down_proj.weight), input_norm=layer.input_layernorm.weight.detach(),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            q_norm=a.q_norm.weight.detach() if hasattr(a, "q_norm") else None,
            k_norm=a.k_norm.weight.detach() if hasattr(a, "k_norm") else None))
    a = model.model.layers[0].self_attn
    heads = cfg.num_attention_heads
    w = model.lm_head.weight
    native = w.device.type == "cpu" and kernels.available()
    fused = pack and native and w.dtype == torch.float32
    return LeanModel(layers, model.model.embed_tokens, model.model.rotary_emb, model.model.norm.weight.detach(),
                     _weight(w), cfg.rms_norm_eps, heads, getattr(cfg, "num_key_value_heads", None) or heads,
                     a.head_dim, a.scaling, pack, fused,
                     native and w.dtype in (torch.float32, torch.bfloat16) and a.head_dim % 16 == 0, params,
                     stamp(params))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm, step for step (float32 statistics, weight applied last)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for the fused [..., 2·I] projection (gate first)."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor [N, heads, W, d] with cos/sin [N, 1, W, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


# Positions per row up to which attention runs the ragged kernel: plain steps and verifies of up to 8 positions (the
# default block 4, a drafter's trained block 8), so that such a verify attends bit for bit as the plain steps it
# replaces. Wider forwards stay on SDPA, whose matmuls win from 16 positions on at long contexts (8 rows × 16 at ~1000
# positions: 245 against 277 ms a forward; docs/bench/forward-profile, *Verifies on the ragged kernel*).
RAGGED_MAX_WIDTH = 8


def ragged(lm: LeanModel, width: int) -> bool:
    """Whether a forward of `width` positions per row attends with the ragged kernel (csrc/attention.cpp): float32
    or bfloat16 on CPU with the kernels built, at decode and verify widths."""
    return lm.ragged_kernel and width <= RAGGED_MAX_WIDTH


def lean_forward(lm: LeanModel, ids: torch.Tensor, pos: torch.Tensor, cache: DynamicCache,
                 mask: torch.Tensor | None, layer_ids: list[int], logits_to_keep: int = 0,
                 rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                 logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """ids, pos [N, W] on top of cache (K/V appended by each cache layer's update; mask: additive
    [N, 1, W, keys] or None for plain causal over one row; rows: instead of a mask, where `ragged` allows, each row's
    committed positions lens [N] and what its block's positions see of the block, see [N, W, W] bool, for the ragged
    kernel) → (float32 logits [N, W or keep, V], features
    [N, W, F] = hidden_states[i + 1] for i in layer_ids, or None). logits=False: features only, and the layers after
    the last of layer_ids do not run (logits come back None)."""
    n, w = ids.shape
    x = lm.embed(ids)
    cos, sin = lm.rotary(x, pos)
    cos, sin = cos[:, None], sin[:, None]
    hq, hk, d = lm.heads * lm.head_dim, lm.kv_heads * lm.head_dim, lm.head_dim
    causal = mask is None and w > 1
    last = len(lm.layers) - 1
    norm = torch.ops.flashdraft.rms_norm if lm.fused else rms_norm
    act = torch.ops.flashdraft.silu_mul if lm.fused else silu_mul
    feats: dict[int, torch.Tensor] = {}
    stop = len(lm.layers) if logits else max(layer_ids, default=last) + 1  # features only: no layer after the last
    for i, L in enumerate(lm.layers[:stop]):
        qkv = packed.linear(norm(x, L.input_norm, lm.eps), L.qkv, L.qkv_bias)
        q = qkv[..., :hq].view(n, w, lm.heads, d)
        k = qkv[..., hq:hq + hk].view(n, w, lm.kv_heads, d)
        v = qkv[..., hq + hk:].view(n, w, lm.kv_heads, d).transpose(1, 2)
        if L.q_norm is not None:
            q, k = norm(q, L.q_norm, lm.eps), norm(k, L.k_norm, lm.eps)
        q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)
        keys, values = cache.layers[i].update(k, v)
        if rows is not None:  # [N, W, heads, d]: already in the layout the output projection reads
            att = torch.ops.flashdraft.ragged_attention(q, keys, values, rows[0], rows[1], lm.scaling).view(n, w, hq)
        else:
            if causal and keys.shape[-2] > w:  # a block on top of a cache: causal inside the block, all before it
                mask = _offset_causal(w, keys.shape[-2], x.dtype, x.device)
                causal = False
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=lm.scaling,
                                                 enable_gqa=lm.kv_heads != lm.heads).transpose(1, 2).reshape(n, w, hq)
        x = x + packed.linear(att, L.o)
        x = x + packed.linear(act(packed.linear(norm(x, L.post_norm, lm.eps), L.gate_up)), L.down)
        if i in layer_ids:
            feats[i] = x
    if stop == len(lm.layers):
        x = norm(x, lm.norm, lm.eps)
        if last in feats:  # HF's last hidden state is the normed one
            feats[last] = x
    features = torch.cat([feats[j] for j in layer_ids], -1) if layer_ids else None
    if not logits:
        return None, features
    keep = x if logits_to_keep == 0 else x[:, -logits_to_keep:]
    return packed.linear(keep, lm.head).float(), features


def _offset_causal(w: int, keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive [1, 1, w, keys]: the last w keys are the block (causal), everything before is visible."""
    see = torch.ones(w, keys, dtype=torch.bool, device=device).tril(keys - w)
    return torch.zeros(see.shape, dtype=dtype, device=device).masked_fill(~see, torch.finfo(dtype).min)[None, None]
