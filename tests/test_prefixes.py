"""Prompt prefix reuse (decoding/prefixes.py): a later turn of a conversation prefills only its new part, and its
cache, features and output are bit for bit those of prefilling it whole."""

from __future__ import annotations

import pytest
import torch
from helpers import random_drafter, tiny_target

from flashdraft.decoding import generate_ids
from flashdraft.decoding.decoder import Decoder
from flashdraft.decoding.prefixes import PrefixCache
from flashdraft.errors import FlashdraftError
from flashdraft import target as T
from flashdraft.target import new_cache

CHUNK = 16


def conversation() -> list[list[int]]:
    """Three turns: each prompt extends the one before (the earlier turns' answers are part of the next prompt)."""
    g = torch.Generator().manual_seed(7)
    first = torch.randint(3, 90, (40,), generator=g).tolist()
    second = first + torch.randint(3, 90, (30,), generator=g).tolist()
    third = second + torch.randint(3, 90, (25,), generator=g).tolist()
    return [first, second, third]


def ids_of(step: int, n: int) -> list[int]:
    return [(i * step + step) % 90 + 3 for i in range(n)]


def joined_state(mib: float, prompts: list[list[int]], block: int) -> tuple[list[dict], Decoder]:
    """Join the prompts one after the other into one decoder → per prompt, its cache row and features once joined,
    and its output."""
    target = tiny_target("llama")
    drafter = random_drafter(target, block_size=4)
    seen: list[dict] = []

    def hook(q):
        if len(q.cycles) == 1:  # just prefilled: its first token only
            row = dec.active.index(q)
            seen.append({"keys": [L.keys[row, :, :q.position].clone() for L in dec.cache.layers],
                         "values": [L.values[row, :, :q.position].clone() for L in dec.cache.layers],
                         "features": torch.cat(q.pending_features).clone()})

    dec = Decoder(target, drafter, adaptive=False, prefill_chunk=CHUNK, hook=hook,
                  prefixes=PrefixCache.of_mib(CHUNK, mib))
    reqs = []
    for i, p in enumerate(prompts):
        q, _ = dec.join(p, max_new_tokens=12, block_size=block, temperature=0.7 if i == 1 else 0.0, seed=i)
        while q in dec.joining:  # prefilled before the next joins, as prepare's stream does for a chunk's turns
            dec.step()
        reqs.append(q)
    while dec.busy:
        dec.step()
    for s, q in zip(seen, reqs):
        s["output"] = q.output
    return seen, dec


def test_a_later_turn_reuses_whole_chunks_and_is_bit_for_bit_the_whole_prefill():
    prompts = conversation()
    cold, dec0 = joined_state(0, prompts, block=4)
    warm, dec = joined_state(64, prompts, block=4)
    assert dec0.prefixes is None
    # turn 2 reuses turn 1's 2 whole chunks (32 of its 40), turn 3 turn 2's 4 (64 of 70)
    assert dec.prefixes.reused_tokens == 32 + 64
    for c, w in zip(cold, warm):
        assert c["output"] == w["output"]
        assert torch.equal(c["features"], w["features"])
        assert all(torch.equal(a, b) for a, b in zip(c["keys"] + c["values"], w["keys"] + w["values"]))
    # turn 3 holds what turn 1 and turn 2 held: one entry is left
    assert len(dec.prefixes.entries) == 1 and len(next(iter(dec.prefixes.entries.values())).ids) == 80


def test_plain_decoding_with_prefix_reuse_equals_the_target_alone():
    """prepare's path: block size 1, no drafter, no features; rows decode together while later turns join; greedy and
    seeded sampling equal decoding each prompt alone."""
    target = tiny_target("qwen3")
    turns = conversation()
    prompts = [turns[0], turns[1], turns[2][:50] + [9] * 20, turns[2]]
    temps = [0.0, 0.9, 0.0, 0.9]
    alone = [generate_ids(target, None, p, block_size=1, lookup=False, max_new_tokens=16, temperature=t, seed=i)
             .output_ids for i, (p, t) in enumerate(zip(prompts, temps))]
    dec = Decoder(target, None, adaptive=False, slots=2, prefill_chunk=CHUNK, prefixes=PrefixCache(CHUNK, 64 << 20))
    waiting, reqs = list(range(len(prompts))), {}
    while waiting or dec.busy:
        while waiting and len(dec.active) + len(dec.joining) < 2:
            i = waiting.pop(0)
            reqs[i], _ = dec.join(prompts[i], block_size=1, lookup=False, max_new_tokens=16, temperature=temps[i],
                                  seed=i)
        dec.step()
    assert [reqs[i].output for i in range(len(prompts))] == alone
    assert dec.prefixes.reused_tokens >= 32 + 32  # turns 2 and 3 (cut) reused turn 1's; turn 3 at least as much


def test_the_cache_keeps_whole_chunks_within_its_budget_and_never_the_last_token():
    target = tiny_target("llama")
    per_token = 2 * 4 * 2 * 16 * 4  # K and V, 4 layers, 2 kv heads, head dim 16, float32

    def prefilled(ids: list[int]):
        cache = new_cache(target)
        T.forward(target, torch.tensor(ids), 0, cache, [], logits_to_keep=1)
        return torch.tensor(ids), cache

    pc = PrefixCache(CHUNK, budget=3 * CHUNK * per_token)
    a, ca = prefilled(ids_of(7, 40))  # 2 whole chunks kept
    pc.add(a, ca, None)
    assert pc.nbytes == 2 * CHUNK * per_token and len(next(iter(pc.entries.values())).ids) == 32
    e, m = pc.usable(a[:32], need_features=False)
    assert m == CHUNK  # the same 32 tokens: the last one is prefilled again for its logits, so one chunk
    assert pc.usable(a, need_features=True) == (None, 0)  # it kept no features
    b, cb = prefilled(ids_of(11, 20))  # another conversation: 1 chunk, the budget is full
    pc.add(b, cb, None)
    assert pc.nbytes == 3 * CHUNK * per_token and len(pc.entries) == 2
    c, cc = prefilled(ids_of(13, 33))  # 2 chunks more: the oldest (a) leaves
    pc.add(c, cc, None)
    assert len(pc.entries) == 2 and pc.nbytes <= pc.budget
    assert pc.usable(a, need_features=False) == (None, 0)  # evicted
    fresh = new_cache(target)
    m, feats = pc.restore(torch.tensor(ids_of(13, 40)), fresh, need_features=False)
    assert (m, feats) == (32, None) and fresh.get_seq_length() == 32
    assert torch.equal(fresh.layers[0].keys[..., :32, :], cc.layers[0].keys[..., :32, :])

    # an entry with features is not replaced by a longer one without (a plain request after a speculative one)
    pc = PrefixCache(CHUNK, budget=1 << 20)
    pc.add(a[:32], ca, [torch.ones(40, 8)])
    pc.add(a, ca, None)
    assert sorted((len(e.ids), e.features is not None) for e in pc.entries.values()) == [(32, False), (32, True)]
    assert pc.usable(a, need_features=True)[0].features is not None and pc.usable(a, need_features=True)[1] == 32
    pc.add(a, ca, [torch.ones(30, 8), torch.ones(10, 8)])  # the same with features: both older ones go
    assert [(len(e.ids), e.features is not None) for e in pc.entries.values()] == [(32, True)]


def test_a_prefix_cache_must_match_the_decoders_prefill_chunk():
    with pytest.raises(FlashdraftError, match="prefill_chunk=16"):
        Decoder(tiny_target("llama"), None, prefill_chunk=32, prefixes=PrefixCache(CHUNK, 1 << 20))


def test_the_server_reuses_a_chat_s_earlier_turns_and_answers_as_generate_does():
    """Two chat turns through the OpenAI server with a small prefill chunk: the second prefills only its new part
    (the /metrics counter says how much), and both answers equal flashdraft's own greedy decoding of the prompt."""
    from fastapi.testclient import TestClient
    from serve_helpers import char_tokenizer

    from flashdraft.decoding import DecodeSettings
    from flashdraft.models import Target
    from flashdraft.serve.app import create_app
    from flashdraft.serve.protocol import Served
    from flashdraft.serve.scheduler import Limits, Scheduler
    from flashdraft.serve.worker import Worker

    model = tiny_target("llama", seed=3)
    target, drafter = Target(model, char_tokenizer(), "tiny"), random_drafter(model, block_size=4)
    worker = Worker(target, drafter, DecodeSettings(), 4, prefill_chunk=CHUNK, prefix_cache_mib=64)
    app = create_app(Scheduler(worker, Limits(request_timeout=60)), Served(["tiny"], target, 16, worker.tokens))
    first = "abcdefghij" * 5
    second = first + " and then klmnopqrst" * 2
    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        outs = []
        for prompt in (first, second):
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                     "temperature": 0})
            assert r.status_code == 200, r.text
            outs.append(r.json()["choices"][0]["text"])
        metrics = client.get("/metrics").text
    reused = [line for line in metrics.splitlines() if line.startswith("flashdraft_prefix_cached_tokens_total")]
    ids = [target.tokenizer.encode(p) for p in (first, second)]
    assert reused == [f"flashdraft_prefix_cached_tokens_total {float((len(ids[0]) - 1) // CHUNK * CHUNK)}"]
    for prompt_ids, text in zip(ids, outs):
        ref = generate_ids(model, drafter, prompt_ids, max_new_tokens=8)
        assert text == target.tokenizer.decode(ref.output_ids)
