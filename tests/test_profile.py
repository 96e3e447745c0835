"""The cost profile: measured plain / verify / draft times on tiny models, and the break-even arithmetic by hand."""

import json
import math

import pytest
import torch

from flashdraft.bench.profile import profile_table
from flashdraft.decoding.costs import best_block, break_even, measure_torch, predict, truncated_tau
from flashdraft.decoding import generate_ids
from flashdraft.dflash2 import upgrade_to_dflash2
from flashdraft.errors import FlashdraftError
from helpers import hf_greedy, random_drafter

# by hand: costs at B=2: 1+12=13 → 13/10; B=4: 2+14=16 → 1.6; B=8: 4+16=20 → 2.0; B=16: 8+24=32 → 3.2
PROFILE = {"engine": "torch", "plain_ms": 10.0, "verify_ms": {2: 12.0, 4: 14.0, 8: 16.0, 16: 24.0},
           "draft_ms": {2: 1.0, 4: 2.0, 8: 4.0, 16: 8.0}, "context_len": 256}


def _finite_positive(d: dict) -> bool:
    return all(math.isfinite(v) and v > 0 for v in d.values())


@pytest.fixture(scope="module")
def drafter(tiny_llama):
    return random_drafter(tiny_llama, block_size=8)


PROMPT = list(range(5, 17))


def test_measure_torch_times_every_block_and_leaves_the_models_alone(tiny_llama, drafter):
    before = {k: v.clone() for k, v in list(tiny_llama.state_dict().items()) + list(drafter.state_dict().items())}
    p = measure_torch(tiny_llama, drafter, [4, 2, 16], PROMPT, tokens=24)
    assert p["engine"] == "torch" and p["context_len"] == 12 + 12
    assert p["plain_ms"] > 0 and math.isfinite(p["plain_ms"])
    assert sorted(p["verify_ms"]) == sorted(p["draft_ms"]) == [2, 4, 16]
    assert _finite_positive(p["verify_ms"]) and _finite_positive(p["draft_ms"])
    assert sorted(break_even(p)) == [2, 4, 16]
    after = list(tiny_llama.state_dict().items()) + list(drafter.state_dict().items())
    assert all(torch.equal(before[k], v) for k, v in after)
    assert generate_ids(tiny_llama, drafter, PROMPT, max_new_tokens=12).output_ids == hf_greedy(tiny_llama, PROMPT, 12)
    json.loads(json.dumps(p))  # a profile is plain data


def test_measure_torch_splits_each_cycle_into_draft_and_the_rest(tiny_llama, drafter, monkeypatch):
    """draft_ms + verify_ms is the whole cycle: per B, (total - prefill) of a stop-free run over its cycles."""
    import flashdraft.decoding.costs as P

    runs = []

    def recorded(model, drafter, ids, settings):
        r = generate_ids(model, drafter, ids, settings)
        runs.append((settings.block_size, settings.max_new_tokens, settings.stop_token_ids, r))
        return r

    monkeypatch.setattr(P, "generate_ids", recorded)
    p = P.measure_torch(tiny_llama, drafter, [2, 8], PROMPT, tokens=20, repeats=1)
    assert [(b, n, s) for b, n, s, _ in runs] == [(8, 8, ()), (1, 20, ()), (2, 20, ()), (8, 20, ())]
    plain, *spec = [r for *_, r in runs[1:]]
    assert plain.num_new_tokens == 20 and len(plain.cycles) == 19
    assert p["plain_ms"] == pytest.approx(1e3 * (plain.timing.total_s - plain.timing.prefill_s) / 19)
    for b, r in zip([2, 8], spec):
        t, n = r.timing, len(r.cycles)
        assert r.num_new_tokens == 20 and p["draft_ms"][b] == pytest.approx(1e3 * t.draft_s / n)
        assert p["draft_ms"][b] + p["verify_ms"][b] == pytest.approx(1e3 * (t.total_s - t.prefill_s) / n)
        # verify(B) is a pass over B positions: drafter chains only, no lookup drafts (max(B, 8) long) and no trees
        blocks = [c.block for c in r.cycles[1:]]
        assert not any(c.lookup or c.parents for c in r.cycles) and max(map(len, blocks)) == b
        assert all(len(x) == b for x in blocks[: -b])  # only the last cycles shrink to the tokens still owed


def test_measure_torch_takes_the_median_of_interleaved_rounds(tiny_llama, drafter, monkeypatch):
    import flashdraft.decoding.costs as P

    runs = []

    def recorded(model, drafter, ids, settings):
        runs.append((settings.block_size, generate_ids(model, drafter, ids, settings)))
        return runs[-1][1]

    monkeypatch.setattr(P, "generate_ids", recorded)
    p = P.measure_torch(tiny_llama, drafter, [2, 8], PROMPT, tokens=16, repeats=3)
    assert [b for b, _ in runs] == [8] + [1, 2, 8] * 3  # a warm-up, then rounds of plain and every block size

    def cycle_ms(r):
        return 1e3 * r.timing.draft_s / len(r.cycles), 1e3 * (r.timing.total_s - r.timing.prefill_s) / len(r.cycles)

    rounds = [dict((b, cycle_ms(r)) for b, r in runs[1 + 3 * i: 4 + 3 * i]) for i in range(3)]
    assert p["plain_ms"] == pytest.approx(sorted(r[1][1] for r in rounds)[1])
    for b in (2, 8):
        assert p["draft_ms"][b] == pytest.approx(sorted(r[b][0] for r in rounds)[1])
        assert p["verify_ms"][b] == pytest.approx(sorted(r[b][1] - r[b][0] for r in rounds)[1])


def test_measure_torch_without_drafter_has_no_draft_cost(tiny_llama):
    p = measure_torch(tiny_llama, None, [2, 8], PROMPT, tokens=8)
    assert p["draft_ms"] == {} and p["verify_ms"] == {} and p["plain_ms"] > 0
    assert break_even(p) == {}


@pytest.mark.parametrize("kind", ["draft_vocab", "dflash2"])
def test_measure_torch_drafter_variants(tiny_llama, drafter, kind):
    d = (upgrade_to_dflash2(drafter, conv_group_size=16, selector_rank=8, selector_top_k=4) if kind == "dflash2"
         else random_drafter(tiny_llama, block_size=8))
    if kind == "draft_vocab":
        d.draft_vocab = torch.arange(0, 96, 3)
    p = measure_torch(tiny_llama, d, [2, 8], PROMPT, tokens=8)
    assert sorted(p["draft_ms"]) == [2, 8] and _finite_positive(p["draft_ms"])


@pytest.mark.parametrize("blocks,prompt,tokens,match", [([1, 4], PROMPT, 8, ">= 2"), ([], PROMPT, 8, ">= 2"),
                                                        ([2], list(range(500)), 16, "context"),
                                                        ([2], [], 8, "context"), ([2], PROMPT, 1, "at least 2")])
def test_measure_torch_bad_inputs(tiny_llama, blocks, prompt, tokens, match):
    with pytest.raises(FlashdraftError, match=match):
        measure_torch(tiny_llama, None, blocks, prompt, tokens)  # tiny target: 512 positions


def test_measure_torch_needs_a_round(tiny_llama):
    with pytest.raises(FlashdraftError, match="at least 1 round"):
        measure_torch(tiny_llama, None, [2], PROMPT, 8, repeats=0)


def test_break_even_by_hand():
    assert break_even(PROFILE) == pytest.approx({2: 1.3, 4: 1.6, 8: 2.0, 16: 3.2})
    partial = dict(PROFILE, draft_ms={4: 2.0})  # only block sizes with a draft cost
    assert break_even(partial) == pytest.approx({4: 1.6})
    assert break_even(dict(PROFILE, draft_ms={})) == pytest.approx({2: 1.2, 4: 1.4, 8: 1.6, 16: 2.4})
    assert break_even(json.loads(json.dumps(PROFILE))) == pytest.approx(break_even(PROFILE))  # string keys
    with pytest.raises(FlashdraftError, match="positive"):
        break_even(dict(PROFILE, plain_ms=0.0))


def test_truncated_tau_by_hand():
    hist = {1: 2, 3: 1, 5: 1}
    assert truncated_tau(hist, 2) == pytest.approx((1 + 1 + 2 + 2) / 4)
    assert truncated_tau(hist, 4) == pytest.approx((1 + 1 + 3 + 4) / 4)
    assert truncated_tau(hist, 16) == pytest.approx((1 + 1 + 3 + 5) / 4)  # nothing to cut: the plain mean
    assert truncated_tau(hist, 1) == 1.0
    assert truncated_tau({}, 4) == 0.0
    assert truncated_tau({"2": 3}, 8) == 2.0
    with pytest.raises(FlashdraftError):
        truncated_tau(hist, 0)
    with pytest.raises(FlashdraftError):
        truncated_tau({0: 1}, 4)


def test_predict_and_best_block_by_hand():
    tau = {2: 1.9, 4: 3.2, 8: 5.0, 16: 6.4, 32: 9.0}  # 32 has no cost: ignored
    assert predict(PROFILE, tau) == pytest.approx({2: 1.9 / 1.3, 4: 2.0, 8: 2.5, 16: 2.0})
    assert best_block(PROFILE, tau) == 8
    assert best_block(PROFILE, {4: 3.2, 16: 6.4}) == 4  # a tie goes to the smaller block
    assert best_block(PROFILE, {2: 1.0}) == 2  # slower than plain (1/1.3), but still the best block
    assert best_block(PROFILE, {32: 9.0}) is None
    assert best_block(PROFILE, {}) is None


def test_profile_table_shows_the_numbers():
    other = {"engine": "llama.cpp", "plain_ms": 4.0, "verify_ms": {"2": 5.0, "16": 9.0}, "draft_ms": {},
             "context_len": 128}
    table = profile_table([PROFILE, other], ["cpu torch", "cpu gguf"], taus=[{8: 5.0, 16: 6.4}, None])
    lines = table.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("| profile") and "break-even τ B=8" in lines[0]
    torch_row, gguf_row = lines[2], lines[3]
    for text in ["cpu torch", "torch", "256", "10.00", "1.20", "1.40", "1.60", "2.40", "4.00", "8.00", "1.30", "3.20",
                 "8 (×2.50)"]:
        assert text in torch_row, text
    cells = [c.strip() for c in gguf_row.strip("|").split("|")]
    assert cells[:6] == ["cpu gguf", "llama.cpp", "128", "4.00", "1.25", "–"]
    assert cells[-1] == "–"
    with pytest.raises(FlashdraftError, match="label"):
        profile_table([PROFILE], ["a", "b"])
