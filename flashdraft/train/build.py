"""The drafter to train: fresh and shaped for the target, or --init-from a drafter (cut, grown or upgraded)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from .. import target as T
from ..checkpoint import build_drafter, check_compatible, load_drafter
from ..config import DrafterConfig, drafter_config_for
from ..dflash2 import upgrade_to_dflash2
from ..errors import FlashdraftError
from .config import TrainConfig


def pick_mask_token_id(tokenizer, vocab_rows: int) -> int:
    """The first embedding row beyond the tokenizer if there is one, else the highest-id unused special token.

    "Unused" means an added special token that is not bos/eos/pad/unk and does not occur in the chat template
    (for SmolLM2 that is `<empty_output>`, id 16).
    """
    n = len(tokenizer)
    if vocab_rows > n:
        return n
    taken = {getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk")}
    template = str(getattr(tokenizer, "chat_template", None) or "")
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    cands = [i for i, t in decoder.items()
             if getattr(t, "special", False) and i not in taken and i < vocab_rows and str(t) not in template]
    if not cands:
        raise FlashdraftError("the target has no spare embedding row or unused special token for the mask token; "
                              "pass --mask-token-id ID")
    return max(cands)


def build_or_load_drafter(cfg: TrainConfig, target) -> nn.Module:
    """A fresh drafter shaped for the target, or --init-from DIR (a DFlash 1 drafter upgrades exactly to --arch
    dflash2: identity convolutions and a zero pair term); fp32 master weights."""
    model = target.model
    if cfg.arch not in (None, "dflash", "dflash2"):
        raise FlashdraftError(f"--arch must be dflash or dflash2, got {cfg.arch!r}")
    drafter = load_initial(cfg) if cfg.init_from else fresh_drafter(cfg, target)
    drafter_config = drafter.config
    check_compatible(drafter_config, T.num_layers(model), T.hidden_size(model), T.vocab_size(model),
                     cfg.init_from or "drafter")
    if drafter_config.block_size < 2:
        raise FlashdraftError(f"--block-size must be >= 2 for training, got {drafter_config.block_size}")
    if cfg.loop_stages > 1 and drafter_config.arch == "dflash2":
        raise FlashdraftError("--loop-stages > 1 trains DFlash 1 drafters only; use a DFlash 1 drafter or "
                              "--loop-stages 1")
    return drafter


def selector_settings(cfg: TrainConfig) -> dict:
    """The DFlash 2 selector settings given on the command line (the rest keep their defaults)."""
    return {k: v for k, v in (("selector_rank", cfg.selector_rank), ("selector_top_k", cfg.selector_top_k))
            if v is not None}


def load_initial(cfg: TrainConfig) -> nn.Module:
    """--init-from DIR in fp32: upgraded to --arch, cut or grown to --num-layers, new block size and mask id."""
    drafter = load_drafter(cfg.init_from, dtype=torch.float32)
    if cfg.arch == "dflash" and drafter.config.arch == "dflash2":
        raise FlashdraftError(f"--init-from {cfg.init_from} is a DFlash 2 drafter; use --arch dflash2 "
                              "(or omit --arch)")
    if cfg.arch == "dflash2" and drafter.config.arch == "dflash":
        drafter = upgrade_to_dflash2(drafter, **selector_settings(cfg))
    if cfg.num_layers is not None:
        set_num_layers(drafter, cfg.num_layers)
    drafter_config = drafter.config
    if cfg.block_size is not None:
        drafter_config.block_size = cfg.block_size
    if cfg.mask_token_id is not None:
        drafter_config.mask_token_id = cfg.mask_token_id
    drafter_config.torch_dtype = "float32"
    return drafter


def fresh_drafter(cfg: TrainConfig, target) -> nn.Module:
    """A new drafter for the target (seeded by --seed), its final norm (and with --target-init, layers) from it."""
    model = target.model
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else pick_mask_token_id(target.tokenizer,
                                                                                         T.vocab_size(model))
    drafter_config: DrafterConfig = drafter_config_for(model.config, mask_id, num_layers=cfg.num_layers or 2,
                                                       block_size=cfg.block_size or 16, torch_dtype="float32")
    drafter_config.arch = cfg.arch or "dflash"
    for k, v in selector_settings(cfg).items():
        setattr(drafter_config, k, v)
    torch.manual_seed(cfg.seed)
    drafter = build_drafter(drafter_config).float()
    init_from_target(drafter, model, cfg.target_init)
    return drafter


def set_num_layers(drafter: nn.Module, n: int) -> None:
    """Keep the warm start's first n layers, or append layers that start as the identity (so drafts are unchanged).

    An appended layer copies the last one with its output projections (attention o_proj, MLP down_proj) zeroed: its
    residual branches add exactly 0 until training moves them, the zero-init residual trick of depth growth.
    """
    drafter_config, have = drafter.config, len(drafter.layers)
    kinds = list(drafter_config.layer_types)
    if n <= have:
        drafter.layers = drafter.layers[:n]
        drafter_config.layer_types = kinds[:n]
    else:
        for _ in range(n - have):
            layer = copy.deepcopy(drafter.layers[have - 1])
            with torch.no_grad():
                for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    proj.weight.zero_()
                    if proj.bias is not None:
                        proj.bias.zero_()
            drafter.layers.append(layer)
        drafter_config.layer_types = kinds + [kinds[have - 1]] * (n - have)
    drafter_config.num_hidden_layers = n


def init_from_target(drafter: nn.Module, model, copy_layers: bool) -> list[str]:
    """Warm-start a fresh drafter from the frozen target; returns the names of the tensors copied.

    Always: the final norm (so the first logits have the LM head's scale). With copy_layers: drafter layer i gets the
    weights of target layer L - n + i wherever names and shapes agree (attention, MLP, norms), and `fc` starts as the
    identity on the last selected feature layer, so the context stream begins as the target's own deep states.
    """
    src = {f"norm.{k}": v for k, v in (T.final_norm(model) or nn.Module()).state_dict().items()}
    layers = getattr(getattr(model, "model", None), "layers", None)
    if copy_layers and layers is not None:
        n = len(drafter.layers)
        for i in range(n):
            src.update({f"layers.{i}.{k}": v for k, v in layers[len(layers) - n + i].state_dict().items()})
    own = drafter.state_dict()
    copied = [k for k, v in src.items() if k in own and own[k].shape == v.shape]
    with torch.no_grad():
        for k in copied:
            own[k].copy_(src[k].float())
        h = drafter.config.hidden_size
        if copy_layers and drafter.fc.weight.shape[1] >= h:
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, -h:] = torch.eye(h)
            copied.append("fc.weight")
    return copied
