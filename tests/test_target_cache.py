"""The target's decode cache (GrowingLayer) and grouped-query SDPA against HF's own DynamicCache and SDPA."""

import random

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM
from transformers.cache_utils import DynamicLayer

from flashdraft import target as T
from flashdraft.decoding import generate_ids
from flashdraft.models import load_target
from helpers import hf_greedy, random_drafter, save_tiny_model_dir, tiny_target
from lossless import assert_greedy_lossless


def _steps(seed: int, total: int) -> list[tuple[int, int]]:
    """(tokens to feed, positions to roll back afterwards) until `total` positions are cached: blocks + rejections."""
    rng, out, n = random.Random(seed), [], 0
    while n < total:
        k = rng.randint(1, 9)
        back = rng.randint(0, k - 1)
        out.append((k, back))
        n += k - back
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_growing_cache_matches_dynamic_cache_across_growth_and_rollback(kind):
    """600 positions of blocks and rollbacks (past the 256 and 512 capacity doublings): the same logits as HF's cache."""
    model = tiny_target(kind, max_pos=1024)
    grown = T.new_cache(model)
    ref = DynamicCache(config=model.config)
    assert all(isinstance(layer, T.GrowingLayer) for layer in grown.layers)
    rng = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for k, back in [(40, 0)] + _steps(0, 600):
            start = grown.get_seq_length()
            assert ref.get_seq_length() == start
            ids = torch.randint(0, model.config.vocab_size, (k,), generator=rng)
            a = T.forward(model, ids, start, grown, [1])
            b = T.forward(model, ids, start, ref, [1])
            torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=0)
            torch.testing.assert_close(a.features, b.features, atol=1e-5, rtol=0)
            T.rollback_to(grown, start + k - back)
            T.rollback_to(ref, start + k - back)
    assert grown.layers[0].keys.shape[-2] >= 600 and grown.get_seq_length() == ref.get_seq_length() >= 600


def test_growing_cache_rejects_a_positive_crop_and_keeps_other_layer_kinds():
    model = tiny_target("llama")
    cache = T.new_cache(model)
    with pytest.raises(ValueError, match="negative"):
        cache.layers[0].crop(3)
    cfg = MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    sliding = T.new_cache(MistralForCausalLM(cfg))
    assert not any(isinstance(layer, T.GrowingLayer) for layer in sliding.layers)
    assert all(type(layer) is not DynamicLayer for layer in sliding.layers)  # sliding-window layers, left alone


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_grouped_sdpa_matches_hf_sdpa_on_masked_blocks(kind):
    """Block verifies (a mask, 2 query heads per K/V head) through enable_gqa give HF's SDPA logits."""
    model = tiny_target(kind)
    assert model.config.num_attention_heads // model.config.num_key_value_heads == 2
    prompt, block = torch.arange(3, 43), torch.arange(50, 58)
    outs = []
    with torch.no_grad():
        for impl in ("sdpa", T.SDPA_GQA):
            model.config._attn_implementation = impl
            cache = T.new_cache(model)
            T.forward(model, prompt, 0, cache, [])
            outs.append(T.forward(model, block, len(prompt), cache, []).logits)
    model.config._attn_implementation = "sdpa"
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)


def test_loaded_target_uses_grouped_sdpa_and_decodes_like_hf(tmp_path):
    """load_target's model (grouped SDPA, growing cache, packed layers) decodes exactly the plain model's greedy."""
    plain = save_tiny_model_dir(tmp_path / "tiny", max_pos=1024)
    loaded = load_target(str(tmp_path / "tiny")).model
    assert loaded.config._attn_implementation == T.SDPA_GQA
    drafter = random_drafter(loaded, block_size=8)
    prompt = list(range(3, 30))
    ref = hf_greedy(plain, prompt, 300)  # long enough to grow the cache past its first capacity
    for bs in (1, 4, 8):
        got = generate_ids(loaded, drafter, prompt, block_size=bs, max_new_tokens=300).output_ids
        assert_greedy_lossless(plain, prompt, got, ref)


def test_grouped_sdpa_is_not_taken_for_flash_attention_and_hf_generate_agrees(tmp_path):
    """transformers treats any attention name containing "flash" as flash attention; generate must match too."""
    from transformers.utils.generic import is_flash_attention_requested

    plain = save_tiny_model_dir(tmp_path / "tiny")
    loaded = load_target(str(tmp_path / "tiny")).model
    assert not is_flash_attention_requested(loaded.config)
    prompt = list(range(3, 30))
    assert hf_greedy(loaded, prompt, 40) == hf_greedy(plain, prompt, 40)
