"""After every cycle the target cache, the drafter's context cache and the output stay aligned."""

import copy

import pytest
import torch

from flashdraft import target as T
from flashdraft.decoding import generate_ids
from helpers import hf_greedy, random_drafter, tiny_target
from lossless import oracle_proposer

LOGIT_TOL = 1e-4  # fp32: cached incremental logits vs a fresh full forward


def _check(model, drafter, state):
    committed = state.committed
    assert committed == len(state.tokens) - 1  # everything but the pending anchor is in the target cache
    # next-token logits through the cache == a fresh forward over all committed tokens + anchor
    cached = T.forward(model, torch.tensor(state.tokens[-1:]), committed, copy.deepcopy(state.target_cache), [])
    fresh = model(torch.tensor([state.tokens])).logits[0, -1].float()
    torch.testing.assert_close(cached.logits[-1], fresh, atol=LOGIT_TOL, rtol=0)
    if drafter is None:
        return
    pending = state.pending
    assert state.draft_cache.length + pending == committed  # drafter context covers exactly the committed positions
    if state.draft_cache.length:
        ids = drafter.config.target_layer_ids
        full = model(torch.tensor([state.tokens[:committed]]), output_hidden_states=True).hidden_states
        feats = torch.cat([full[i + 1] for i in ids], -1)[:, : state.draft_cache.length]
        expect = drafter.context_kv(feats, torch.arange(feats.shape[1])[None])
        for (k, v), (ek, ev) in zip(state.draft_cache.kv, expect):
            torch.testing.assert_close(k, ek, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, ev, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_aligned_every_cycle(kind, temperature):
    model = tiny_target(kind)
    drafter = random_drafter(model, block_size=8)
    prompt = list(range(3, 40))
    n_cycles = []
    with torch.no_grad():
        res = generate_ids(model, drafter, prompt, block_size=8, max_new_tokens=30, temperature=temperature,
                           state_hook=lambda s: (_check(model, drafter, s), n_cycles.append(1)))
    assert len(n_cycles) == len(res.cycles) + 1  # prefill + every cycle checked


def test_caches_aligned_with_partial_acceptance():
    """Oracle drafts accepted in part: rollback must drop exactly the rejected positions."""
    model = tiny_target("llama")
    prompt = list(range(3, 20))
    ref = hf_greedy(model, prompt, 40)
    with torch.no_grad():
        res = generate_ids(model, None, prompt, block_size=8, max_new_tokens=40,
                           propose=oracle_proposer(ref, 0.2, seed=0, vocab=model.config.vocab_size),
                           state_hook=lambda s: _check(model, None, s))
    assert res.output_ids == ref
    assert len({c.accepted for c in res.cycles}) > 2
