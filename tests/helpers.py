"""Tiny random targets and drafters built in code (no downloads)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from flashdraft.checkpoint import build_drafter
from flashdraft.config import drafter_config_for
from flashdraft.target import use_lean

VOCAB = 96
MASK_ID = VOCAB - 1  # a row the tiny targets never need to emit


def tiny_target(kind: str = "llama", seed: int = 0, vocab: int = VOCAB, layers: int = 4, max_pos: int = 512,
                init_std: float = 0.2, lean: bool = True) -> torch.nn.Module:
    """A 4-layer random causal LM; a wide init gives peaked logits (few near-ties). lean: decode through lean.py, as
    load_target sets it up (False: through the Hugging Face forward)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_pos,
                  initializer_range=init_std, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                  tie_word_embeddings=False)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, rope_theta=10000.0))
    else:
        raise ValueError(kind)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model = model.float().eval()
    if lean:
        use_lean(model)
    return model


def random_drafter(target: torch.nn.Module, seed: int = 1, num_layers: int = 2, block_size: int = 8,
                   init_std: float = 0.2, mask_id: int | None = None, **overrides) -> torch.nn.Module:
    """A random DFlash drafter shaped for target (mask id: the last vocabulary row)."""
    torch.manual_seed(seed)
    mask_id = target.config.vocab_size - 1 if mask_id is None else mask_id
    cfg = drafter_config_for(target.config, mask_id, num_layers=num_layers, block_size=block_size,
                             torch_dtype="float32")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    drafter = build_drafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() > 1:
                p.normal_(0, init_std)
    return drafter.float().eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy decoding via transformers generate."""
    x = torch.tensor([prompt], device=model.device)  # an explicit mask: generate would read pad ids as padding
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                         min_new_tokens=0)
    return out[0, len(prompt):].tolist()


def tiny_tokenizer(vocab: int = VOCAB):
    """A word-level tokenizer over the words t0..t{vocab-1} with a ChatML-like template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1")
    fast.chat_template = "{% for m in messages %}t2 {{ m['content'] }} t3 {% endfor %}{% if add_generation_prompt %}t4{% endif %}"
    return fast


def save_tiny_model_dir(path, kind: str = "llama", **kw):
    """Write a tiny target + tokenizer as a local HF model directory; returns the model."""
    model = tiny_target(kind, **kw)
    model.save_pretrained(path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return model
