"""The lean forward (flashdraft/lean.py) computes what the Hugging Face forward does, on every path that uses it."""

import os

import pytest
import torch
from helpers import tiny_target
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from flashdraft import kernels, lean
from flashdraft import target as T
from flashdraft.packed import pack_linears
from flashdraft.target_batch import BatchCache, forward_batch


def tiny_qwen2() -> torch.nn.Module:
    """A Qwen2 target: q/k/v biases, which the fused projection must carry."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)
    model = Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.5)
    return model

# The fused RMSNorm (csrc/fused.cpp) sums its squares in another order than torch's mean: a few float32 ulps per
# norm, which 8 norms deep in a random tiny model reach 2.5e-5 on a hidden state. The ragged attention kernel
# (csrc/attention.cpp, verifies too) sums its softmax lane by lane: with the fused norms, one logit of 384 of a
# verify 1.5e-5 from HF's (the argmax the same).
FEATURE_ATOL = 5e-5
LOGIT_ATOL = 3e-5


def pair(kind: str, packed: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same weights twice: decoding through HF and through lean.py."""
    make = tiny_qwen2 if kind == "qwen2" else lambda **kw: tiny_target(kind, **kw)
    hf, fast = make(lean=False) if kind != "qwen2" else make(), make(lean=False) if kind != "qwen2" else make()
    for m in (hf, fast):
        T.use_grouped_sdpa(m)
        if packed:
            pack_linears(m)
    assert T.use_lean(fast) and fast.flashdraft_lean is not None
    return hf, fast


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2"])
@torch.inference_mode()
def test_single_sequence_prefill_verify_and_tree_equal_hf(kind, packed):
    hf, fast = pair(kind, packed)
    prompt = torch.randint(0, 90, (37,), generator=torch.Generator().manual_seed(1))
    block = torch.tensor([5, 9, 13, 2])
    last = T.num_layers(hf) - 1
    for layer_ids in ([0, 2], [1, last]):  # the last layer's feature is the normed output, as in HF
        caches = [T.new_cache(m) for m in (hf, fast)]
        outs = [T.forward(m, prompt, 0, c, layer_ids) for m, c in zip((hf, fast), caches)]
        outs += [T.forward(m, block, 37, c, layer_ids) for m, c in zip((hf, fast), caches)]
        for c in caches:
            T.rollback_to(c, 37)
        parents = [-1, 0, -1]  # a tree: two children of the anchor, one grandchild
        outs += [T.forward(m, block[:4], 37, c, layer_ids, parents=parents) for m, c in zip((hf, fast), caches)]
        for a, b in zip(outs[::2], outs[1::2]):
            torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=LOGIT_ATOL)
            torch.testing.assert_close(b.features, a.features, rtol=1e-5, atol=FEATURE_ATOL)
            assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))


@pytest.mark.skipif(not kernels.available() and os.environ.get("FLASHDRAFT_REQUIRE_KERNEL") != "1",
                    reason="no C++ compiler or ninja: the fused forward needs the native kernels")
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@torch.inference_mode()
def test_a_verify_is_bit_for_bit_the_plain_steps_it_replaces(kind):
    """The default CPU forward (packed float32: matvec, fused norms, ragged attention at every decode width): a block
    verified in one forward gives exactly the logits and features of feeding it one token at a time, alone and in a
    ragged batch, so speculative greedy decoding cannot part from plain decoding even at a logit near-tie."""
    _, m = pair(kind, packed=True)
    assert lean.current(m).fused and lean.ragged(lean.current(m), 8)
    prompt = torch.randint(0, 90, (37,), generator=torch.Generator().manual_seed(1))
    block = [5, 9, 13, 2, 77, 40, 1, 64]
    cache = T.new_cache(m)
    T.forward(m, prompt, 0, cache, [0, 1])
    verify = T.forward(m, torch.tensor(block), 37, cache, [0, 1])
    T.rollback_to(cache, 37)
    steps = [T.forward(m, torch.tensor([t]), 37 + j, cache, [0, 1]) for j, t in enumerate(block)]
    assert torch.equal(verify.logits, torch.cat([s.logits for s in steps]))
    assert torch.equal(verify.features, torch.cat([s.features for s in steps]))

    blocks = [block[:4], block[:1], block]
    batch = BatchCache(m)
    for n in (5, 23, 11):
        single = T.new_cache(m)
        T.forward(m, torch.arange(n) % 90, 0, single, [0, 1])
        batch.add_row(single)
    verified = forward_batch(m, blocks, [None] * 3, batch, [0, 1])  # writes K/V past lens, commits nothing
    stepped = []
    for j in range(len(block)):  # a row whose block ended repeats its last token, unread below
        stepped.append(forward_batch(m, [[b[min(j, len(b) - 1)]] for b in blocks], [None] * 3, batch, [0, 1]))
        batch.lens += 1
    for i, b in enumerate(blocks):
        assert torch.equal(verified[i].logits, torch.cat([stepped[j][i].logits for j in range(len(b))]))
        assert torch.equal(verified[i].features, torch.cat([stepped[j][i].features for j in range(len(b))]))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@torch.inference_mode()
def test_ragged_batch_verify_equals_hf(kind):
    hf, fast = pair(kind, packed=True)
    outs = []
    for m in (hf, fast):
        cache = BatchCache(m)
        for n in (5, 23, 11):
            single = T.new_cache(m)
            T.forward(m, torch.arange(n) % 90, 0, single, [1])
            cache.add_row(single)
        outs.append(forward_batch(m, [[3, 4, 5, 6], [7], [8, 9, 10]], [None, None, [-1, -1]], cache, [1, 2]))
        outs.append(forward_batch(m, [[11], [12], [13]], [None] * 3, cache, [1, 2]))  # plain steps: the ragged kernel
    assert lean.ragged(lean.current(fast), 1) == kernels.available()
    for a, b in zip(outs[0] + outs[1], outs[2] + outs[3]):
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.features, a.features, rtol=1e-5, atol=FEATURE_ATOL)


@torch.inference_mode()
def test_ragged_batch_plain_steps_in_bfloat16_are_as_close_as_hf():
    """A bfloat16 target (a store grown on AMX): its plain steps attend through the ragged kernel too. Against the
    same bfloat16 weights computed in float32, its logits err no more than HF's bfloat16 forward (whose SDPA rounds
    elsewhere: the two differ by ~3 bfloat16 ulps of a logit), and its greedy tokens are HF's."""
    def plain_steps(model) -> torch.Tensor:
        cache = BatchCache(model)
        for n in (5, 40, 11):
            single = T.new_cache(model)
            T.forward(model, torch.arange(n) % 90, 0, single, [])
            cache.add_row(single)
        return torch.stack([o.logits for step in range(3) for o in
                            forward_batch(model, [[11 + step], [12], [13 + 2 * step]], [None] * 3, cache, [])])

    hf, fast = (tiny_target("llama", lean=lean_).to(torch.bfloat16) for lean_ in (False, True))
    exact = plain_steps(tiny_target("llama", lean=False).to(torch.bfloat16).float())
    assert lean.ragged(lean.current(fast), 1) == kernels.available()
    got, want = plain_steps(fast), plain_steps(hf)
    assert (got - exact).abs().mean() <= 1.25 * (want - exact).abs().mean()
    assert (got - exact).abs().max() <= 1.25 * (want - exact).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_unsupported_targets_keep_the_hf_forward():
    torch.manual_seed(0)
    windowed = MistralForCausalLM(MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                sliding_window=16)).eval()
    assert not lean.supported(windowed)
    assert not T.use_lean(windowed) and windowed.flashdraft_lean is None
    assert lean.supported(tiny_target("llama", lean=False))


@torch.inference_mode()
def test_grad_mode_takes_the_hf_forward(monkeypatch):
    """Training runs the target with autograd; the lean copies are frozen, so that path must not be taken."""
    model = tiny_target("llama")
    monkeypatch.setattr(lean, "lean_forward", lambda *a, **k: pytest.fail("lean forward under autograd"))
    with torch.enable_grad():
        T.forward(model, torch.tensor([1, 2, 3]), 0, T.new_cache(model), [1])


def test_changed_weights_are_never_served_from_stale_fused_copies():
    """The fused copies are rebuilt when a weight is edited in place or the model changes dtype."""
    model, ref = tiny_target("llama"), tiny_target("llama", lean=False)
    ids = torch.tensor([1, 2, 3, 4])
    with torch.inference_mode():
        T.forward(model, ids, 0, T.new_cache(model), [1])  # the fused copies are taken
    with torch.no_grad():
        for m in (model, ref):
            m.model.layers[1].mlp.up_proj.weight.mul_(1.5)
    with torch.inference_mode():
        a = T.forward(model, ids, 0, T.new_cache(model), [1])
        b = T.forward(ref, ids, 0, T.new_cache(ref), [1])
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
        model.to(torch.bfloat16)
        assert T.forward(model, ids, 0, T.new_cache(model), [1]).features.dtype == torch.bfloat16


@torch.inference_mode()
def test_batch_cache_joins_and_leaves_without_copying_the_cache():
    """Rows live in preallocated slots: joining writes one slot, leaving moves the last row into the hole, and the
    buffers are the same tensors throughout; every row keeps exactly its own K/V."""
    model = tiny_target("llama", max_pos=300)
    cache, singles = BatchCache(model, slots=4), []
    for n in (5, 9, 7, 3):
        single = T.new_cache(model)
        T.forward(model, torch.arange(n) + n, 0, single, [])
        singles.append(single)
        cache.add_row(single)
    ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    order = cache.remove_rows([0, 2])
    assert order == [3, 1] and cache.lens.tolist() == [3, 9]
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers] == ptrs
    for row, old in enumerate(order):
        n = singles[old].get_seq_length()
        for layer, one in zip(cache.layers, singles[old].layers):
            assert torch.equal(layer.keys[row, :, :n], one.keys[0, :, :n])
            assert torch.equal(layer.values[row, :, :n], one.values[0, :, :n])
    cache.ensure(10_000)  # never beyond the context (max_pos 300) unless a verify needs it
    assert cache.capacity == 10_000
    cache2 = BatchCache(model, slots=2)
    cache2.add_row(singles[0])
    cache2.ensure(290)
    assert cache2.capacity == 300  # doubling is capped at the context
