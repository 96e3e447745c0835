"""The embedded default target (SmolLM2-135M-Instruct): random and shipped drafters, lossless against HF greedy."""

import pytest
import torch

from flashdraft.checkpoint import build_drafter
from flashdraft.config import drafter_config_for
from flashdraft.decoding import generate_ids
from flashdraft.models import load_target
from helpers import hf_greedy
from lossless import assert_greedy_lossless

pytestmark = pytest.mark.slow

PROMPTS = ["What is 17 * 23?", "Write a Python function that reverses a string.",
           "Name three colors. " * 60]  # the last is a ~280-token prompt


@pytest.fixture(scope="module")
def smol():
    torch.set_num_threads(2)
    target = load_target(dtype="float32")
    torch.manual_seed(0)
    drafter = build_drafter(drafter_config_for(target.model.config, 16, num_layers=1, block_size=16)).float().eval()
    return target, drafter


@pytest.fixture(scope="module")
def reference():
    """The oracle: an unmodified transformers model from the same weights (none of flashdraft's packed linears or
    attention), so flashdraft's kernels are never on both sides of a comparison."""
    from transformers import AutoModelForCausalLM

    from flashdraft.models import resolve_target

    model = AutoModelForCausalLM.from_pretrained(resolve_target(None), dtype=torch.float32).eval()
    assert model.config._attn_implementation == "sdpa" and type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    return model


@pytest.mark.parametrize("prompt,block_sizes", [(PROMPTS[0], [1, 2, 4, 8, 16]), (PROMPTS[1], [4, 16]),
                                                 (PROMPTS[2], [1, 16])])
def test_smollm2_greedy_lossless(smol, reference, prompt, block_sizes):
    target, drafter = smol
    ids = target.encode(prompt)
    ref = hf_greedy(reference, ids, 16)
    for bs in block_sizes:
        res = generate_ids(target.model, drafter, ids, block_size=bs, max_new_tokens=16,
                           stop_token_ids=target.stop_token_ids())
        assert_greedy_lossless(reference, ids, res.output_ids, ref)


def test_smollm2_stops_at_eos(smol, reference):
    target, drafter = smol
    ids = target.encode("Reply with just the word yes.")
    ref = reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64)[0, len(ids):].tolist()
    assert ref[-1] == 2 and len(ref) < 64  # the target itself stops at <|im_end|>
    res = generate_ids(target.model, drafter, ids, block_size=16, max_new_tokens=64, stop_token_ids=[2])
    assert res.output_ids == ref


def test_shipped_drafter_is_registered_lossless_and_accepts(smol, reference):
    """The packaged default drafter: z-lab bf16 files, used by default, lossless, and it actually accepts drafts."""
    from flashdraft.models import load_drafter_for, registered_drafter

    target, _ = smol
    path = registered_drafter(target.name)
    assert path is not None and (path / "model.safetensors").stat().st_size < 30e6 and (path / "README.md").is_file()
    drafter = load_drafter_for(target, None)
    assert drafter.config.block_size == 4 and drafter.config.mask_token_id == 16  # registered: block 4 on CPU
    assert load_drafter_for(target, path).config.block_size == 8  # the checkpoint was trained at block 8
    assert drafter.draft_vocab is not None and 2 in drafter.draft_vocab  # proposes EOS among its frequent tokens
    ids = target.encode("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
                        "in May. How many clips did Natalia sell altogether in April and May?")
    ref = hf_greedy(reference, ids, 64)
    res = generate_ids(target.model, drafter, ids, max_new_tokens=64, stop_token_ids=target.stop_token_ids())
    assert_greedy_lossless(reference, ids, res.output_ids, ref)
    assert res.tau > 1.2, res.tau  # a trained drafter, not a random one (τ ≈ 1)
    looped = generate_ids(target.model, drafter, ids, max_new_tokens=64, stop_token_ids=target.stop_token_ids(),
                          loop_stages=2, loop_gate=-2.0)
    assert_greedy_lossless(reference, ids, looped.output_ids, ref)


def test_packed_layers_decode_like_the_plain_torch_target(smol, reference):
    """The default CPU path (oneDNN-packed linears) against the same target on torch's own linears."""
    from flashdraft.models import load_drafter_for
    from flashdraft.packed import is_packed

    target, _ = smol
    plain = load_target(dtype="float32", packed=False)
    assert is_packed(target.model) and not is_packed(plain.model)
    drafter = load_drafter_for(target, None)
    assert is_packed(drafter) and not is_packed(load_drafter_for(plain, None))
    ids = target.encode("Write a Python function that returns the n-th Fibonacci number.")
    ref = hf_greedy(reference, ids, 48)
    for model in (target.model, plain.model):
        res = generate_ids(model, drafter if model is target.model else load_drafter_for(plain, None), ids,
                           max_new_tokens=48, stop_token_ids=target.stop_token_ids())
        assert_greedy_lossless(reference, ids, res.output_ids, ref)
