"""prepare's answers come from the batched decoder: every answer equals the target's own greedy decoding, and the
features and top-k stored beside it equal a plain full forward over the finished sequence."""

import pytest
import torch

from flashdraft.train.data import answer_prompts, pass_groups
from helpers import hf_greedy, tiny_target


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 90, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_answers_equal_greedy_with_refills_features_and_topk(kind):
    model = tiny_target(kind)
    ps = prompts(23)
    order = sorted(range(len(ps)), key=lambda i: len(ps[i]))
    # 5 rows for 23 prompts: rows leave and new prompts join many times over
    got = dict(answer_prompts(model, ps, order, rows=5, max_new_tokens=30, temperature=0.0, stop_ids=[7], seed=0,
                              layer_ids=[0, 2], topk=4))
    assert sorted(got) == list(range(len(ps)))
    for i, p in enumerate(ps):
        s = got[i]
        ref = hf_greedy(model, p, 30)
        if 7 in ref:
            ref = ref[: ref.index(7) + 1]
        assert s.input_ids.tolist() == p + ref, i
        assert s.loss_mask.tolist() == [False] * len(p) + [True] * len(ref)
        assert s.finished == (ref[-1] == 7)
        with torch.no_grad():
            out = model(s.input_ids[None], output_hidden_states=True)
        feats = torch.cat([out.hidden_states[1][0], out.hidden_states[3][0]], -1)
        torch.testing.assert_close(s.features.float(), feats.to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)
        lp = torch.log_softmax(out.logits[0, len(p) - 1:-1].float(), -1)  # rows predicting each response token
        vals, idx = lp.topk(4, -1)
        assert torch.equal(s.topk_ids[len(p):].long(), idx)
        torch.testing.assert_close(s.topk_logprobs[len(p):].float(), vals, atol=1e-2, rtol=1e-3)
        assert not s.topk_ids[: len(p)].any() and not s.topk_logprobs[: len(p)].any()  # zero on the prompt


def test_without_features_answers_come_as_they_finish():
    model = tiny_target("llama")
    ps = prompts(9, seed=1)
    ps[3] = ps[3][:2]  # among longer prompts: finishes early
    stream = answer_prompts(model, ps, list(range(9)), rows=4, max_new_tokens=12, temperature=0.0, stop_ids=[],
                            seed=0, layer_ids=None, topk=0)
    got = list(stream)
    assert sorted(k for k, _ in got) == list(range(9))
    for k, s in got:
        assert s.input_ids.tolist() == ps[k] + hf_greedy(model, ps[k], 12)
        assert s.features is None and s.topk_ids is None and not s.finished


def test_sampled_answers_depend_on_the_seed_and_not_on_the_batch():
    model = tiny_target("llama")
    ps = prompts(6, seed=2)
    kw = dict(max_new_tokens=16, temperature=1.0, stop_ids=[], layer_ids=None, topk=0)
    one = dict(answer_prompts(model, ps, list(range(6)), rows=1, seed=3, **kw))
    four = dict(answer_prompts(model, ps, list(range(6)), rows=4, seed=3, **kw))
    other = dict(answer_prompts(model, ps, list(range(6)), rows=4, seed=4, **kw))
    assert all(torch.equal(one[k].input_ids, four[k].input_ids) for k in range(6))
    assert any(not torch.equal(one[k].input_ids, other[k].input_ids) for k in range(6))


def test_pass_groups_bound_padding():
    assert pass_groups([5, 6, 7, 30, 31, 90], 64) == [[0, 1, 2], [3, 4], [5]]
    assert pass_groups([100], 64) == [[0]]  # a sequence longer than the budget goes alone


def test_sliding_window_targets_are_answered_one_prompt_at_a_time():
    """A target whose cache cannot be shared by ragged rows still gets its own greedy answers (past its window)."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8, max_position_embeddings=256)
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    ps = prompts(4, seed=3)
    eos = [model.generation_config.eos_token_id]  # what hf_greedy stops on
    got = dict(answer_prompts(model, ps, [0, 1, 2, 3], rows=4, max_new_tokens=20, temperature=0.0, stop_ids=eos,
                              seed=0, layer_ids=None, topk=0))
    assert all(got[k].input_ids.tolist() == p + hf_greedy(model, p, 20) for k, p in enumerate(ps))
