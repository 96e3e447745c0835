"""Speculative sampling reproduces the target's own sampling distribution (end to end, tiny model)."""


import pytest
import torch
from scipy.stats import chisquare

import flashdraft.decoding.loop as decode_mod
from flashdraft.decoding import generate_ids
from flashdraft.sampling_params import SamplingParams
from flashdraft.sampling import process, sample
from helpers import random_drafter, tiny_target

ALPHA = 1e-3  # false-alarm rate: a correct sampler fails this test once in a thousand seeds
VOCAB, PROMPT, NEW = 8, [1, 5, 3], 3
LOOKUP_PROMPT = [1, 5, 3, 6, 1, 5]  # repeats: prompt lookup finds an earlier n-gram in about a third of the runs


@pytest.fixture(scope="module")
def tiny():
    target = tiny_target("llama", vocab=VOCAB, init_std=0.3, seed=3)
    drafter = random_drafter(target, init_std=0.3, seed=4)  # its q is far from the target's p
    return target, drafter


@torch.no_grad()
def exact_distribution(target, params: SamplingParams, prompt: list[int] = PROMPT) -> dict[tuple, float]:
    """P(x0, x1, x2 | prompt) under plain sampling from the processed target distribution, by enumeration."""
    probs: dict[tuple, float] = {(): 1.0}
    for _ in range(NEW):
        nxt = {}
        for seq, pr in probs.items():
            if pr == 0:
                continue
            p = process(target(torch.tensor([prompt + list(seq)])).logits[0, -1], params)
            for tok in range(VOCAB):
                nxt[seq + (tok,)] = pr * float(p[tok])
        probs = nxt
    return probs


def empirical(target, drafter, params, block_size, n, seed0=0, prompt: list[int] = PROMPT, lookup: bool = False,
              lookups: list[int] | None = None) -> dict[tuple, int]:
    """Counts of each output over n seeds; lookups (if given) collects each run's prompt-lookup cycles."""
    counts: dict[tuple, int] = {}
    for s in range(seed0, seed0 + n):
        out = generate_ids(target, drafter, prompt, block_size=block_size, max_new_tokens=NEW,
                           temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=s,
                           lookup=lookup)
        key = tuple(out.output_ids)
        counts[key] = counts.get(key, 0) + 1
        if lookups is not None:
            lookups.append(out.lookup_cycles)
    return counts


def chi2_pvalue(counts: dict[tuple, int], exact: dict[tuple, float]) -> float:
    """Goodness of fit over the joint of all NEW tokens; cells expected < 5 pooled into one."""
    n = sum(counts.values())
    assert all(exact.get(k, 0) > 0 for k in counts), "emitted a sequence the target can never produce"
    big = [k for k, p in exact.items() if p * n >= 5]
    obs = [counts.get(k, 0) for k in big]
    exp = [exact[k] * n for k in big]
    rest_exp = n - sum(exp)
    if rest_exp > 1e-9:
        obs.append(n - sum(obs))
        exp.append(rest_exp)
    return chisquare(obs, exp).pvalue


CASES = [(SamplingParams(1.0), 3), (SamplingParams(0.8, top_k=5, top_p=0.9), 2)]


@pytest.mark.parametrize("params,block_size", CASES)
def test_speculative_sampling_matches_target(tiny, params, block_size):
    target, drafter = tiny
    counts = empirical(target, drafter, params, block_size, 1500)
    p = chi2_pvalue(counts, exact_distribution(target, params))
    assert p > ALPHA, f"speculative samples do not follow the target distribution (chi2 p={p:.2e})"


def accept_all(drafts, q, p, gen):
    """A broken verifier: keeps every draft."""
    return drafts.shape[0], int(sample(p[-1], gen))


@pytest.mark.parametrize("prompt,lookup", [(PROMPT, False), (LOOKUP_PROMPT, True)])
def test_accept_all_verifier_fails_the_same_test(tiny, monkeypatch, prompt, lookup):
    monkeypatch.setattr(decode_mod, "accept_sampling", accept_all)
    target, drafter = tiny
    params, block_size = CASES[0]
    counts = empirical(target, drafter, params, block_size, 1500, prompt=prompt, lookup=lookup)
    exact = exact_distribution(target, params, prompt)
    impossible = any(exact.get(k, 0) == 0 for k in counts)
    assert impossible or chi2_pvalue(counts, exact) < ALPHA


def test_speculative_sampling_with_a_draft_vocabulary_matches_target(tiny):
    """A drafter restricted to some tokens (draft_vocab) samples q over them only; the output is still the target's."""
    target, drafter = tiny
    drafter.draft_vocab = torch.tensor([0, 2, 3, 5, 6])
    try:
        params = SamplingParams(1.0)
        p = chi2_pvalue(empirical(target, drafter, params, 3, 1500, seed0=10_000), exact_distribution(target, params))
    finally:
        drafter.draft_vocab = None
    assert p > ALPHA, f"speculative samples do not follow the target distribution (chi2 p={p:.2e})"


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=5, top_p=0.9)])
def test_speculative_sampling_with_prompt_lookup_matches_target(tiny, params):
    """Lookup drafts are deterministic (q one-hot): each is kept with the target's probability of it."""
    target, drafter = tiny
    lookups: list[int] = []
    counts = empirical(target, drafter, params, 3, 1500, seed0=20_000, prompt=LOOKUP_PROMPT, lookup=True,
                       lookups=lookups)
    assert sum(n > 0 for n in lookups) > len(lookups) // 5  # the path under test ran
    p = chi2_pvalue(counts, exact_distribution(target, params, LOOKUP_PROMPT))
    assert p > ALPHA, f"speculative samples with prompt lookup do not follow the target distribution (chi2 p={p:.2e})"
