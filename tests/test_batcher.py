"""Continuous batching for prepare: every answer equals the target's own greedy decoding, features and top-k equal
a plain full forward over the finished sequence."""

import pytest
import torch

from flashdraft.train.batcher import Batcher
from helpers import hf_greedy, tiny_target


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 90, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_answers_equal_greedy_with_refills_and_compaction(kind, monkeypatch):
    model = tiny_target(kind)
    ps = prompts(40)
    shifts = []
    compact = Batcher.compact
    monkeypatch.setattr(Batcher, "compact", lambda self: (shifts.append(self.hi), compact(self)))
    stop = [7]
    # 5 rows for 23 prompts forces refills; a short width forces compaction many times over.
    b = Batcher(model, rows=5, max_prompt=40, max_new_tokens=30, stop_ids=stop, pad_id=0, layer_ids=[0, 2], topk=4)
    answers = {a.index: a for a in b.run(ps, admit_at=2)}
    assert sorted(answers) == list(range(len(ps))) and len(shifts) >= 2  # the pointer wrapped several times
    for i, p in enumerate(ps):
        a = answers[i]
        ref = hf_greedy(model, p, 30)
        if 7 in ref:
            ref = ref[: ref.index(7) + 1]
        assert a.ids == p + ref, i
        assert a.finished == (ref[-1] == 7)
        with torch.no_grad():
            out = model(torch.tensor([a.ids]), output_hidden_states=True)
        feats = torch.cat([out.hidden_states[1][0], out.hidden_states[3][0]], -1)
        torch.testing.assert_close(a.features.float(), feats.to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)
        lp = torch.log_softmax(out.logits[0, len(p) - 1:-1].float(), -1)  # rows predicting each response token
        vals, idx = lp.topk(4, -1)
        assert torch.equal(a.topk_ids.long()[:, 0], idx[:, 0])
        torch.testing.assert_close(a.topk_logprobs.float(), vals, atol=1e-2, rtol=1e-3)


def test_without_features_rows_leave_at_once():
    model = tiny_target("llama")
    ps = prompts(9, seed=1)
    b = Batcher(model, rows=4, max_prompt=40, max_new_tokens=12, stop_ids=[], pad_id=0)
    answers = {a.index: a for a in b.run(ps)}
    for i, p in enumerate(ps):
        assert answers[i].ids == p + hf_greedy(model, p, 12)
        assert answers[i].features is None and answers[i].topk_ids is None
