"""Shared checks for lossless decoding: exact equality, or a proven logit near-tie."""

from __future__ import annotations

import warnings

import torch

from flashdraft.decoding import generate_ids

NEAR_TIE = 1e-4  # fp32 logit gap below which block-vs-single-token numerics may flip an argmax


class NearTieWarning(UserWarning):
    """A greedy divergence that the target's own logits show to be a near-tie: reported, never passed silently."""


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_greedy_lossless(model, prompt: list[int], got: list[int], ref: list[int]) -> None:
    """got must equal ref token for token; a divergence passes only as a documented near-tie of the target's logits."""
    i = first_divergence(got, ref)
    if i is None:
        return
    assert i < min(len(got), len(ref)), f"lengths differ with equal prefixes: {len(got)} vs {len(ref)}"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:i]])).logits[0, -1].float()
    gap = float((logits[ref[i]] - logits[got[i]]).abs())
    assert gap < NEAR_TIE, (f"divergence at new token {i}: got {got[i]}, target greedy {ref[i]}, logit gap {gap:.3g} "
                            f"is not a near-tie (< {NEAR_TIE}) — this is a bug")
    note = (f"greedy divergence at new token {i} is a logit near-tie (gap {gap:.2e} < {NEAR_TIE}); "
            "outputs agree up to that point")
    print(f"lossless: {note}")  # in the captured output of the test, beside pytest's warnings summary
    warnings.warn(note, NearTieWarning)


def oracle_proposer(reference: list[int], error_rate: float, seed: int, vocab: int):
    """Drafts that follow the target's known greedy continuation, corrupted at random: exercises every accept path."""
    gen = torch.Generator().manual_seed(seed)

    def propose(state, start, b):
        emitted = len(state.tokens) - state.num_prompt_tokens
        want = reference[emitted: emitted + b - 1]
        want = want + [int(torch.randint(vocab, (1,), generator=gen))] * (b - 1 - len(want))
        drafts = torch.tensor(want)
        flip = torch.rand(b - 1, generator=gen) < error_rate
        drafts[flip] = (drafts[flip] + 1 + torch.randint(vocab - 1, (int(flip.sum()),), generator=gen)) % vocab
        return drafts, None

    return propose


def generate_drafted(*args, **kw):
    """generate_ids with prompt lookup and draft trees off unless asked: every cycle is the drafter's (or the given
    proposer's) chain, for tests of the drafter's own accounting (official-loop blocks, DLoop stages, draft vocabulary)."""
    return generate_ids(*args, **{"lookup": False, "tree": 0, **kw})
