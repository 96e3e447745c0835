"""A draft vocabulary: the drafter proposes only listed tokens; decoding stays lossless and the file round-trips."""

import json

import pytest
import torch

from flashdraft.checkpoint import load_drafter, save_drafter
from flashdraft.errors import FlashdraftError
from helpers import hf_greedy, random_drafter, tiny_target
from lossless import generate_drafted as generate_ids


VOCAB_IDS = torch.tensor(sorted(set(range(0, 96, 3)) | {7, 11}))


def test_draft_logits_are_the_full_logits_on_the_vocabulary_and_minus_inf_elsewhere():
    target = tiny_target()
    drafter = random_drafter(target)
    head = target.get_output_embeddings()
    h = torch.randn(5, 64)
    full = drafter.logits(h, head)
    drafter.draft_vocab = VOCAB_IDS
    got = drafter.draft_logits(h, head)
    torch.testing.assert_close(got[:, VOCAB_IDS], full[:, VOCAB_IDS])
    outside = torch.ones(full.shape[-1], dtype=torch.bool)
    outside[VOCAB_IDS] = False
    assert torch.isneginf(got[:, outside]).all()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size", [2, 8])
def test_greedy_with_a_draft_vocabulary_is_lossless_and_drafts_only_from_it(kind, block_size):
    target = tiny_target(kind)
    drafter = random_drafter(target)
    drafter.draft_vocab = VOCAB_IDS
    prompt = list(range(5, 40))
    out = generate_ids(target, drafter, prompt, block_size=block_size, max_new_tokens=40)
    assert out.output_ids == hf_greedy(target, prompt, 40)
    drafted = {t for c in out.cycles for t in c.block[1:]}
    assert drafted and drafted <= set(VOCAB_IDS.tolist())


def test_draft_vocabulary_round_trips_and_bad_files_are_one_line_errors(tmp_path):
    target = tiny_target()
    drafter = random_drafter(target)
    drafter.draft_vocab = VOCAB_IDS
    save_drafter(drafter, tmp_path / "d")
    assert json.loads((tmp_path / "d" / "draft_vocab.json").read_text())["ids"] == VOCAB_IDS.tolist()
    assert torch.equal(load_drafter(tmp_path / "d").draft_vocab, VOCAB_IDS)
    for bad in ('{"ids": [1, 2, 999]}', '{"ids": []}', "not json", '{"tokens": [1]}'):
        (tmp_path / "d" / "draft_vocab.json").write_text(bad)
        with pytest.raises(FlashdraftError, match="draft_vocab.json"):
            load_drafter(tmp_path / "d")
    (tmp_path / "d" / "draft_vocab.json").unlink()
    assert load_drafter(tmp_path / "d").draft_vocab is None
