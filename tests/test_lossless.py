"""Greedy speculative decoding equals the target's own greedy decoding, token for token (fp32)."""

import pytest
import torch

from flashdraft.decoding import generate_ids
from helpers import hf_greedy, random_drafter, tiny_target
from lossless import assert_greedy_lossless, oracle_proposer

BLOCK_SIZES = [1, 2, 4, 8, 16]
PROMPT_LENGTHS = [1, 7, 60, 300]


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab - 1, (n,), generator=torch.Generator().manual_seed(seed + n)).tolist()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request):
    target = tiny_target(request.param)
    return target, random_drafter(target, block_size=16)


@pytest.mark.parametrize("n_prompt", PROMPT_LENGTHS)
def test_random_drafter_greedy_equals_hf(pair, n_prompt):
    target, drafter = pair
    prompt = _prompt(n_prompt, target.config.vocab_size)
    ref = hf_greedy(target, prompt, 40)
    for bs in BLOCK_SIZES:
        got = generate_ids(target, drafter, prompt, block_size=bs, max_new_tokens=40).output_ids
        assert_greedy_lossless(target, prompt, got, ref)


@pytest.mark.parametrize("error_rate", [0.0, 0.15, 0.5])
@pytest.mark.parametrize("n_prompt", [1, 60])
def test_partial_acceptance_paths_are_lossless(pair, error_rate, n_prompt):
    """An oracle drafter right most of the time makes cycles accept 0..B-1 drafts; output must not change."""
    target, _ = pair
    vocab = target.config.vocab_size
    prompt = _prompt(n_prompt, vocab, seed=1)
    ref = hf_greedy(target, prompt, 48)
    for bs in BLOCK_SIZES[1:]:
        res = generate_ids(target, None, prompt, block_size=bs, max_new_tokens=48,
                           propose=oracle_proposer(ref, error_rate, seed=bs, vocab=vocab), lookup=False)
        assert_greedy_lossless(target, prompt, res.output_ids, ref)
        accepted = {c.accepted for c in res.cycles}
        if error_rate == 0.0:
            assert res.tau > bs - 1  # full blocks accepted (the last may be cut by max_new_tokens)
        elif error_rate == 0.15 and bs >= 4:
            assert len(accepted) > 1 and max(accepted) > 0  # a mix of partial and fuller acceptances


def test_stop_token_truncates_inside_accepted_block(pair):
    target, drafter = pair
    vocab = target.config.vocab_size
    prompt = _prompt(20, vocab, seed=2)
    ref = hf_greedy(target, prompt, 64)
    stop = ref[9]  # the first occurrence decides where the target itself would stop
    cut = ref.index(stop) + 1
    for bs in BLOCK_SIZES:
        res = generate_ids(target, None, prompt, block_size=bs, max_new_tokens=64,
                           stop_token_ids=[stop], propose=oracle_proposer(ref, 0.0, seed=0, vocab=vocab))
        assert res.output_ids == ref[:cut]
    # the same through the real (random) drafter, against transformers' own stopping
    hf = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=64, eos_token_id=stop,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert hf == ref[:cut]
    for bs in BLOCK_SIZES:
        got = generate_ids(target, drafter, prompt, block_size=bs, max_new_tokens=64, stop_token_ids=[stop]).output_ids
        assert got == ref[:cut]


def test_full_block_acceptance_reports_accepted_counts(pair):
    target, _ = pair
    prompt = _prompt(10, target.config.vocab_size, seed=3)
    ref = hf_greedy(target, prompt, 33)
    res = generate_ids(target, None, prompt, block_size=8, max_new_tokens=33,
                       propose=oracle_proposer(ref, 0.0, seed=0, vocab=target.config.vocab_size), lookup=False)
    assert res.output_ids == ref
    # 1 (prefill) + 4 cycles x 8 tokens = 33: as in the official loop, no cycle runs once every token owed is emitted
    assert [c.accepted for c in res.cycles] == [7, 7, 7, 7] and res.acceptance_lengths == [8, 8, 8, 8]
    for c in res.cycles:
        assert len(c.block) == 8 and c.emitted == c.block[1:] + [c.emitted[-1]]
    res = generate_ids(target, None, prompt, block_size=8, max_new_tokens=30,
                       propose=oracle_proposer(ref, 0.0, seed=0, vocab=target.config.vocab_size), lookup=False)
    assert res.output_ids == ref[:30]
    # 29 tokens owed after the prefill: three full blocks, then verify_size = min(8, 5 + 1): the anchor and the
    # 5 drafts still owed; all are kept and the target's bonus token is not emitted
    assert [len(c.block) for c in res.cycles] == [8, 8, 8, 6]
    assert res.cycles[-1].accepted == 5 and res.cycles[-1].emitted == res.cycles[-1].block[1:]


def test_context_limit_stops_like_the_target():
    target = tiny_target("llama", max_pos=64)
    drafter = random_drafter(target, block_size=16)
    prompt = _prompt(55, target.config.vocab_size)
    ref = hf_greedy(target, prompt, 9)  # 55 + 9 = 64 positions: the whole context
    for bs in [1, 4, 16]:
        res = generate_ids(target, drafter, prompt, block_size=bs, max_new_tokens=50)
        assert res.output_ids == ref
        assert all(len(c.block) <= 64 - 55 for c in res.cycles)


@pytest.mark.parametrize("dflash2", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_bf16_target_and_drafter_run(dflash2, packed):
    """bf16 runs end to end (DFlash 2's selector and oneDNN-packed layers too); the lossless claim is tested in
    fp32 (bf16 block/step numerics may differ). On a CPU without oneDNN's bf16 path (AVX2 only) packing must
    leave the layers on torch's own linears instead of raising."""
    from flashdraft.dflash2 import upgrade_to_dflash2
    from flashdraft.packed import pack_linears, packable

    target = tiny_target("qwen3")
    drafter = random_drafter(target)
    if dflash2:
        drafter = upgrade_to_dflash2(drafter, conv_group_size=16, selector_rank=8, selector_top_k=4)
    target, drafter = target.to(torch.bfloat16), drafter.to(torch.bfloat16)
    if packed:
        n_target, n_drafter = pack_linears(target), pack_linears(drafter)
        if packable("cpu", torch.bfloat16):
            assert n_target > 0 and n_drafter > 0
        else:
            assert n_target == n_drafter == 0
    res = generate_ids(target, drafter, list(range(3, 20)), block_size=8, max_new_tokens=20)
    assert res.num_new_tokens == 20 and all(0 <= t < target.config.vocab_size for t in res.output_ids)
