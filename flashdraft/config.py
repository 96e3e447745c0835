"""Drafter configuration: read and write the z-lab `config.json` (DFlash and DFlash 2)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from transformers import Qwen3Config

from .errors import FlashdraftError

ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spread layer ids from layer 1 to L-3 (one draft layer: the middle layer)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    """Everything needed to build a drafter; field names follow the Qwen3 / z-lab config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: list[int]
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    is_causal: bool | None = None  # the official per-layer causality switch; None: only sliding layers are causal
    attention_bias: bool = False
    hidden_act: str = "silu"
    input_embedding_scale: float | None = None  # multiplies the block's token embeddings (DFlash 2 checkpoints)
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    torch_dtype: str = "bfloat16"
    arch: str = "dflash"
    # DFlash 2 only
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise FlashdraftError(
                f"config.json: layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}; make them agree"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise FlashdraftError("config.json: sliding_attention layers need a positive sliding_window")
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            raise FlashdraftError(f"config.json: is_causal must be true, false or absent, got {self.is_causal!r}")
        if self.block_size < 1:
            raise FlashdraftError(f"config.json: block_size must be >= 1, got {self.block_size}")

    @property
    def target_hidden_size(self) -> int:
        """The drafter shares the target's embedding and LM head, so their widths match."""
        return self.hidden_size

    def to_qwen3(self):
        """A transformers Qwen3Config with the same backbone fields (for RoPE, norms, MLP)."""
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        if "type" in rope and "rope_type" not in (self.rope_scaling or {}):
            rope["rope_type"] = rope.pop("type")
        return Qwen3Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, rope_parameters=rope,
            hidden_act=self.hidden_act, attention_bias=self.attention_bias,
        )


def layer_attention(kind: str, is_causal: bool | None, sliding_window: int | None) -> tuple[bool, int | None]:
    """(causal, window) of a layer kind, as the official code decides it.

    A present is_causal applies to every layer; absent, sliding layers are causal and full layers are not.
    Only sliding layers have a window.
    """
    causal = kind == "sliding_attention" if is_causal is None else is_causal
    return causal, sliding_window if kind == "sliding_attention" else None


def _pick(raw: dict, dflash: dict, key: str, default: Any = None) -> Any:
    """Newer files put some keys inside dflash_config; older ones at top level."""
    if key in dflash and dflash[key] is not None:
        return dflash[key]
    return raw.get(key, default)


def config_from_dict(raw: dict, source: str = "config.json") -> DrafterConfig:
    """Parse a z-lab / official DFlash or DFlash 2 config dict."""
    archs = raw.get("architectures") or ["DFlashDraftModel"]
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise FlashdraftError(
            f"{source}: architectures {archs} is not a DFlash drafter (expected one of {sorted(ARCHITECTURES)})"
        )
    dflash = raw.get("dflash_config") or {}
    required = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    missing = [k for k in required if raw.get(k) is None]
    if missing:
        raise FlashdraftError(f"{source}: missing required field(s) {missing}")
    mask_token_id = _pick(raw, dflash, "mask_token_id")
    if mask_token_id is None:
        raise FlashdraftError(f"{source}: no mask_token_id (expected in dflash_config)")
    n_layers = raw["num_hidden_layers"]
    num_target_layers = _pick(raw, dflash, "num_target_layers")
    layer_ids = _pick(raw, dflash, "target_layer_ids")
    if layer_ids is None:
        if num_target_layers is None:
            raise FlashdraftError(f"{source}: needs target_layer_ids or num_target_layers")
        layer_ids = default_target_layer_ids(num_target_layers, n_layers)
    rope_params = raw.get("rope_parameters") or {}
    rope_theta = raw.get("rope_theta") or rope_params.get("rope_theta") or 1_000_000.0
    rope_scaling = raw.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    heads = raw["num_attention_heads"]
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    return DrafterConfig(
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"], num_hidden_layers=n_layers,
        num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, vocab_size=raw["vocab_size"],
        num_target_layers=num_target_layers if num_target_layers is not None else max(layer_ids) + 1,
        mask_token_id=int(mask_token_id), target_layer_ids=[int(i) for i in layer_ids],
        block_size=int(_pick(raw, dflash, "block_size", 16)), rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 32768), rope_theta=float(rope_theta),
        rope_scaling=rope_scaling, layer_types=list(raw.get("layer_types") or []),
        sliding_window=raw.get("sliding_window"), is_causal=raw.get("is_causal"),
        attention_bias=bool(raw.get("attention_bias", False)),
        hidden_act=raw.get("hidden_act", "silu"),
        input_embedding_scale=_scale(_pick(raw, dflash, "input_embedding_scale"), source),
        output_multiplier=_pick(raw, dflash, "output_multiplier"),
        final_logit_softcapping=_pick(raw, dflash, "final_logit_softcapping"),
        torch_dtype=str(dtype).replace("torch.", ""), arch=arch,
        conv_kernel_size=int(_pick(raw, dflash, "conv_kernel_size", 2)),
        conv_group_size=int(_pick(raw, dflash, "conv_group_size", 16)),
        selector_rank=int(_pick(raw, dflash, "selector_rank", 256)),
        selector_top_k=int(_pick(raw, dflash, "selector_top_k", 16)),
    )


def _scale(value, source: str) -> float | None:
    """input_embedding_scale: absent, or a finite positive number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise FlashdraftError(f"{source}: input_embedding_scale must be a finite number > 0, got {value!r}")
    return float(value)


def config_to_dict(config: DrafterConfig) -> dict:
    """The official layout: Qwen3 fields at top level, DFlash fields in dflash_config (and block_size both)."""
    d = asdict(config)
    dflash = {"mask_token_id": config.mask_token_id, "target_layer_ids": config.target_layer_ids,
              "block_size": config.block_size}
    for key in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
        if d[key] is not None:
            dflash[key] = d[key]
    if config.arch == "dflash2":
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            dflash[key] = d[key]
    arch_name = {v: k for k, v in ARCHITECTURES.items()}[config.arch]
    out = {"architectures": [arch_name], "model_type": "qwen3"}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings",
                "rope_theta", "rope_scaling", "layer_types", "sliding_window", "attention_bias", "hidden_act"):
        out[key] = d[key]
    out["use_sliding_window"] = "sliding_attention" in config.layer_types
    if config.is_causal is not None:
        out["is_causal"] = config.is_causal
    out["tie_word_embeddings"] = False
    out["torch_dtype"] = config.torch_dtype
    out["block_size"] = config.block_size
    out["num_target_layers"] = config.num_target_layers
    out["dflash_config"] = dflash
    return out


def load_config(path: str | Path) -> DrafterConfig:
    """Read `config.json` from a drafter directory."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise FlashdraftError(f"{file} not found: --drafter must be a directory with config.json and *.safetensors") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FlashdraftError(f"{file} is not valid JSON ({e}); re-export the drafter") from None
    if not isinstance(raw, dict):
        raise FlashdraftError(f"{file} must hold a JSON object")
    return config_from_dict(raw, str(file))


def drafter_config_for(target_config, mask_token_id: int, num_layers: int = 1, block_size: int = 16,
                       intermediate_size: int | None = None, torch_dtype: str = "bfloat16") -> DrafterConfig:
    """A new drafter shaped like the target (width, heads, RoPE) with num_layers layers."""
    tc = target_config.get_text_config()
    heads = tc.num_attention_heads
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    theta = getattr(tc, "rope_theta", None) or rope.get("rope_theta", 10000.0)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type", "default") != "default" else None
    return DrafterConfig(
        hidden_size=tc.hidden_size, intermediate_size=intermediate_size or tc.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads, vocab_size=tc.vocab_size,
        num_target_layers=tc.num_hidden_layers, mask_token_id=mask_token_id,
        target_layer_ids=default_target_layer_ids(tc.num_hidden_layers, num_layers), block_size=block_size,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6), max_position_embeddings=tc.max_position_embeddings,
        rope_theta=float(theta), rope_scaling=scaling, torch_dtype=torch_dtype,
    )
