"""oneDNN-packed linear layers: same numbers as F.linear, and decoding on them stays lossless (greedy and sampled)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from flashdraft import packed
from flashdraft.decoding import generate_ids
from flashdraft.dflash2 import upgrade_to_dflash2
from flashdraft.sampling_params import SamplingParams
from helpers import hf_greedy, random_drafter, tiny_target
from lossless import assert_greedy_lossless
from test_sampling_lossless import ALPHA, chi2_pvalue, empirical, exact_distribution

pytestmark = pytest.mark.skipif(not packed.packable("cpu", torch.float32), reason="needs torch built with oneDNN")


@pytest.mark.parametrize("shape", [(1, 1, 48), (1, 8, 48), (3, 9, 48), (16, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(shape, bias):
    torch.manual_seed(0)
    w, b, x = torch.randn(80, 48), torch.randn(80) if bias else None, torch.randn(shape)
    got = packed.linear(x, packed.pack_weight(w), b)
    assert got.shape == (*shape[:-1], 80) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)  # fp32 rounding, not bf16's 1e-2


def packed_pair(kind="llama", **drafter_kw):
    """(plain target, packed copy, plain drafter, packed copy)."""
    target = tiny_target(kind)
    drafter = random_drafter(target, **drafter_kw)
    pt, pd = copy.deepcopy(target), copy.deepcopy(drafter)
    assert packed.pack_linears(pt) == 4 * 7 + 1 and packed.pack_linears(pd) > 0
    return target, pt, drafter, pd


def test_packed_model_keeps_its_weights_and_matches_logits():
    target, pt, _, _ = packed_pair()
    assert packed.is_packed(pt) and not packed.is_packed(target)
    assert packed.pack_linears(pt) == 0  # idempotent
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), pt.state_dict().values()))
    ids = torch.randint(0, 90, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(pt(ids).logits, target(ids).logits, rtol=1e-4, atol=1e-4)


def test_packed_linear_takes_the_plain_weight_when_autograd_is_live():
    """A frozen packed target's head still backpropagates into a drafter's hidden states (training's loss)."""
    _, pt, _, _ = packed_pair()
    head = pt.get_output_embeddings()
    x = torch.randn(4, 64, requires_grad=True)
    head(x).square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    F.linear(x2, head.weight).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_env_switch_turns_packing_off(monkeypatch):
    monkeypatch.setenv("FLASHDRAFT_PACKED", "0")
    assert packed.pack_linears(tiny_target()) == 0
    assert not packed.packable("cpu", torch.float32) and not packed.packable("meta", torch.float32)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_on_packed_layers_equals_plain_hf_greedy(kind):
    """Packed target + packed DFlash 2 drafter with a draft vocabulary vs the unpacked target's own greedy."""
    target, pt, drafter, _ = packed_pair(kind, block_size=8)
    d2 = upgrade_to_dflash2(drafter, conv_group_size=16, selector_rank=8, selector_top_k=4)
    d2.draft_vocab = torch.arange(0, 96, 2)
    packed.pack_linears(d2)
    for n in (1, 40):
        prompt = list(range(3, 3 + n))
        ref = hf_greedy(target, prompt, 40)
        for bs in (1, 4, 8):
            got = generate_ids(pt, d2, prompt, block_size=bs, max_new_tokens=40).output_ids
            assert_greedy_lossless(target, prompt, got, ref)
    head = d2._draft_head[1]  # the packed head ran
    assert packed.is_packed(pt.get_output_embeddings()) and (isinstance(head, packed.BlockedWeight) or head.is_mkldnn)


def test_sampling_on_packed_layers_follows_the_target():
    target = tiny_target("llama", vocab=8, init_std=0.3, seed=3)
    drafter = random_drafter(target, init_std=0.3, seed=4)
    packed.pack_linears(target)
    packed.pack_linears(drafter)
    params = SamplingParams(1.0, 0, 1.0)
    counts = empirical(target, drafter, params, 4, 1500)
    p = chi2_pvalue(counts, exact_distribution(target, params))
    assert p > ALPHA, f"speculative samples on packed layers do not follow the target (chi2 p={p:.2e})"


@pytest.mark.skipif(not packed.kernels.available() or not packed.huge_pages_allowed(),
                    reason="needs the native matvec kernel and Linux's madvise(MADV_HUGEPAGE)")
def test_packed_weights_live_in_huge_page_memory_and_give_the_same_numbers(monkeypatch):
    """Packed float32 weights are carved from 2 MiB-aligned chunks madvised for transparent huge pages (a 4-row
    replay of the default target's linears: 26 -> 21 ms on a 2-core Xeon); FLASHDRAFT_HUGE_PAGES=0 keeps them in
    ordinary memory. Both give bit for bit the same results."""
    torch.manual_seed(0)
    w, x = torch.randn(200, 96), torch.randn(5, 96)
    huge = packed.pack_weight(w)
    chunk = packed._arena["chunk"]
    base, ptr = chunk.data_ptr(), huge.blocks.data_ptr()
    assert base % packed.HUGE_PAGE == 0 and base <= ptr < base + chunk.numel() and ptr % 64 == 0
    monkeypatch.setenv("FLASHDRAFT_HUGE_PAGES", "0")
    plain = packed.pack_weight(w)
    assert not base <= plain.blocks.data_ptr() < base + chunk.numel()
    assert torch.equal(packed.linear(x, huge), packed.linear(x, plain))
    big = torch.randn(packed.ARENA_CHUNK // 4 // 64 + 64, 64)  # more than a chunk: a chunk of its own
    monkeypatch.setenv("FLASHDRAFT_HUGE_PAGES", "1")
    y = x[:, :64]
    assert torch.equal(packed.linear(y, packed.pack_weight(big)), packed.linear(y, packed.pack_weight(big)))
    assert packed._arena["chunk"].numel() >= big.numel() * 4
