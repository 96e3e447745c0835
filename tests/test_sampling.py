"""Pure verification and sampling rules, tested without any model."""

import pytest
import torch
from scipy.stats import chisquare

from flashdraft.errors import FlashdraftError
from flashdraft.sampling_params import SamplingParams
from flashdraft.sampling import accept_greedy, accept_sampling, process

ALPHA = 1e-3  # false-alarm rate of every statistical test in this file


def test_accept_greedy_prefix_rule():
    target = torch.tensor([5, 6, 7, 8])
    assert accept_greedy(torch.tensor([5, 6, 7]), target) == (3, 8)  # all kept, bonus from the last position
    assert accept_greedy(torch.tensor([5, 9, 7]), target) == (1, 6)  # stop at the first mismatch
    assert accept_greedy(torch.tensor([1, 6, 7]), target) == (0, 5)  # later matches do not count
    assert accept_greedy(torch.zeros(0, dtype=torch.long), target[:1]) == (0, 5)  # block size 1


def test_process_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = process(logits, SamplingParams(1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    p = process(logits, SamplingParams(1.0, top_p=0.7))  # smallest prefix reaching 0.7: {0.5, 0.2}
    torch.testing.assert_close(p, torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    p = process(logits, SamplingParams(1.0, top_p=0.71))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    p = process(logits, SamplingParams(1.0, top_p=0.01))  # the top token always survives
    torch.testing.assert_close(p, torch.tensor([1.0, 0, 0, 0, 0]))
    p = process(logits[None].repeat(2, 1), SamplingParams(25.0, top_p=5e-324))  # 0 in float32: still the top token
    torch.testing.assert_close(p, torch.tensor([[1.0, 0, 0, 0, 0]] * 2))
    hot = process(logits, SamplingParams(2.0))
    torch.testing.assert_close(hot, torch.softmax(logits / 2, -1))


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_params(kw):
    with pytest.raises(FlashdraftError):
        SamplingParams(**{"temperature": 1.0, **kw})


def _first_token_counts(verify, p, q, trials, seed=0):
    """Emit one token per trial: a draft from q[0] verified against p; count the emitted first token."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1])
    for _ in range(trials):
        drafts = torch.multinomial(q, 1, generator=gen)[:, 0]
        n, nxt = verify(drafts, q, p, gen)
        first = int(drafts[0]) if n > 0 else nxt
        counts[first] += 1
    return counts


P = torch.tensor([[0.45, 0.3, 0.15, 0.1, 0.0], [0.1, 0.2, 0.3, 0.2, 0.2], [0.2] * 5])
Q = torch.tensor([[0.05, 0.1, 0.25, 0.3, 0.3], [0.2] * 5])  # clearly not p, puts mass where p has none


def test_accept_sampling_emits_target_distribution():
    counts = _first_token_counts(accept_sampling, P, Q, 6000)
    keep = P[0] > 0
    assert counts[~keep].sum() == 0  # a token with p = 0 is never emitted
    stat = chisquare(counts[keep].numpy(), (P[0][keep] * counts.sum()).numpy())
    assert stat.pvalue > ALPHA, stat


def test_accept_everything_verifier_is_caught():
    def accept_all(drafts, q, p, gen):
        return drafts.shape[0], int(torch.multinomial(p[-1], 1, generator=gen))

    counts = _first_token_counts(accept_all, P, Q, 6000)
    keep = P[0] > 0
    assert counts[~keep].sum() > 0 or chisquare(counts[keep].numpy(), (P[0][keep] * counts[keep].sum()).numpy()).pvalue < ALPHA


def test_accept_sampling_identical_p_q_accepts_all():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 7, generator=gen), -1)
    drafts = torch.multinomial(p[:3], 1, generator=gen)[:, 0]
    for _ in range(50):
        n, _ = accept_sampling(drafts, p[:3], p, gen)
        assert n == 3


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 1e-6])
def test_tiny_temperatures_decode_greedily(temperature):
    """logits / 1e-45 is inf: such temperatures are greedy (below MIN_TEMPERATURE), never NaN probabilities."""
    from flashdraft.decoding import generate_ids
    from flashdraft.sampling_params import MIN_TEMPERATURE
    from helpers import random_drafter, tiny_target

    assert temperature < MIN_TEMPERATURE and SamplingParams(temperature).greedy
    assert not SamplingParams(MIN_TEMPERATURE).greedy
    target = tiny_target("llama")
    prompt = list(range(5, 17))
    for drafter in (None, random_drafter(target, block_size=4)):
        greedy = generate_ids(target, drafter, prompt, max_new_tokens=24)
        tiny = generate_ids(target, drafter, prompt, max_new_tokens=24, temperature=temperature, seed=7)
        assert tiny.output_ids == greedy.output_ids
        assert [c.block for c in tiny.cycles] == [c.block for c in greedy.cycles]  # trees and all, as at T = 0
