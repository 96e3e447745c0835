"""Prompt lookup: the n-gram search itself, and decoding with lookup drafts stays lossless (greedy, fp32)."""

import json

import pytest
import torch

from flashdraft.checkpoint import save_drafter
from flashdraft.cli import main
from flashdraft.decoding import generate_ids
from flashdraft.dflash2 import upgrade_to_dflash2
from flashdraft.errors import FlashdraftError
from flashdraft.lookup import lookup_drafts
from helpers import hf_greedy, random_drafter, save_tiny_model_dir, tiny_target
from lossless import assert_greedy_lossless


@pytest.mark.parametrize("tokens,k,expected", [
    ([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 4, [7, 5, 1, 2]),  # the latest earlier occurrence of [1, 2, 3]
    ([4, 5, 6, 8, 9, 5, 6, 7, 4, 5, 6], 2, [8, 9]),  # the longest suffix wins over a later, shorter match
    ([1, 2, 3, 4, 1, 2], 9, [3, 4, 1, 2, 3, 4, 1, 2, 3]),  # running into the end continues with the period
    ([7, 7, 7, 7], 3, [7, 7, 7]),
    ([1, 2, 3, 4, 5], 3, []),  # nothing recurs
    ([9, 1, 5, 2, 1], 3, []),  # a single recurring token is not a match
    ([1, 2, 3, 1, 2], 0, []),
    ([1], 3, []),
])
def test_lookup_drafts(tokens, k, expected):
    assert lookup_drafts(tokens, k) == expected


def test_lookup_ngram_bounds():
    tokens = [1, 2, 3, 4, 8, 2, 3, 4, 9, 1, 2, 3, 4]
    assert lookup_drafts(tokens, 1) == [8]  # 4-gram [1, 2, 3, 4] at the start, not the later 3-gram
    assert lookup_drafts(tokens, 1, max_ngram=3) == [9]  # [2, 3, 4] last occurred before 9
    assert lookup_drafts([5, 1, 6, 1], 2, min_ngram=1) == [6, 1]


def _repetitive_prompt(vocab: int, seed: int) -> list[int]:
    phrase = torch.randint(3, vocab - 1, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
    return phrase * 3 + phrase[:4]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_lookup_decoding_equals_target(kind):
    """Lookup drafts, alone or grafted onto the drafter's trees, keep the target's greedy output at every block size."""
    target = tiny_target(kind)
    drafter = random_drafter(target, block_size=16)
    looked = grown = 0
    for seed in range(3):
        prompt = _repetitive_prompt(target.config.vocab_size, seed)
        ref = hf_greedy(target, prompt, 40)
        for bs in [2, 4, 8, 16]:
            res = generate_ids(target, drafter, prompt, block_size=bs, max_new_tokens=40)
            assert_greedy_lossless(target, prompt, res.output_ids, ref)
            # lookup cycles verify a chain of max(bs, 8) rows at most; drafter cycles the default tree (7 nodes)
            assert res.config["lookup"] is True and all(
                len(c.block) <= max(bs, 8) if c.lookup else c.parents is not None and len(c.block) <= 8
                for c in res.cycles if len(c.block) > 1)
            assert all(c.stages == (0 if c.lookup else 1) for c in res.cycles if len(c.block) > 1)
            looked += res.lookup_cycles
            # lookup="tree": every cycle is the drafter's tree (one pass, 7 nodes), a lookup draft one more path of it
            grafted = generate_ids(target, drafter, prompt, block_size=bs, max_new_tokens=40, lookup="tree")
            assert grafted.output_ids == ref and grafted.config["lookup"] == "tree" and grafted.lookup_cycles > 0
            drafted = [c for c in grafted.cycles if len(c.block) > 1]
            assert all(c.parents is not None and c.stages == 1 for c in drafted)
            assert all(len(c.block) <= 1 + 7 + (max(bs, 8) - 1 if c.lookup else 0) for c in drafted)
            looked += grafted.lookup_cycles
            grown += sum(len(c.block) > 8 for c in drafted)  # a lookup path added rows beyond the tree's 8
            off = generate_ids(target, drafter, prompt, block_size=bs, max_new_tokens=40, lookup=False)
            assert off.output_ids == ref and off.lookup_cycles == 0 and not off.config["lookup"]
    assert looked > 10 and grown > 0  # the paths under test ran


def test_lookup_with_loops_and_dflash2_is_lossless():
    target = tiny_target("qwen3")
    d2 = upgrade_to_dflash2(random_drafter(target, block_size=8, seed=7), conv_group_size=16, selector_rank=8,
                            selector_top_k=4)
    prompt = _repetitive_prompt(target.config.vocab_size, 5)
    ref = hf_greedy(target, prompt, 32)
    res = generate_ids(target, d2, prompt, block_size=8, max_new_tokens=32, loop_stages=3, loop_gate=float("-inf"))
    assert res.output_ids == ref and res.lookup_cycles > 0
    grafted = generate_ids(target, d2, prompt, block_size=8, max_new_tokens=32, lookup="tree")  # selector trees
    assert grafted.output_ids == ref and grafted.lookup_cycles > 0
    assert any(c.stages > 1 for c in res.cycles if not c.lookup)  # DLoop still drafts the cycles lookup leaves


def test_lookup_drafts_a_loop_whole():
    """This target falls into a loop (73 73 73 ...): lookup drafts the loop deep and the target keeps it."""
    target = tiny_target("qwen3")
    drafter = random_drafter(target, block_size=8)
    prompt = torch.randint(3, 90, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_greedy(target, prompt, 60)
    on = generate_ids(target, drafter, prompt, block_size=8, max_new_tokens=60)
    off = generate_ids(target, drafter, prompt, block_size=8, max_new_tokens=60, lookup=False)
    assert on.output_ids == off.output_ids == ref and ref.count(73) >= 10
    assert max(c.accepted for c in on.cycles if c.lookup) == 7  # a whole block
    assert on.tau > off.tau


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookup")
    model = save_tiny_model_dir(root / "target", kind="qwen3")
    save_drafter(random_drafter(model, block_size=8), root / "drafter")
    return model, root


def test_cli_generate_lookup_switch(dirs, capsys):
    model, root = dirs
    prompt = _repetitive_prompt(model.config.vocab_size, 2)
    base = ["generate", "--target", str(root / "target"), "--drafter", str(root / "drafter"), "--prompt-ids",
            ",".join(map(str, prompt)), "--max-new-tokens", "24", "--json"]
    ref = hf_greedy(model, prompt, 24)
    assert main(base) == 0
    out = capsys.readouterr()
    on = json.loads(out.out)
    n = sum(c["lookup"] for c in on["cycles"])
    assert on["output_ids"] == ref and on["config"]["lookup"] and n > 0
    assert f"({n} by prompt lookup)" in out.err
    assert main([*base, "--no-lookup"]) == 0
    out = capsys.readouterr()
    off = json.loads(out.out)
    assert off["output_ids"] == ref and not off["config"]["lookup"] and not any(c["lookup"] for c in off["cycles"])
    assert "prompt lookup" not in out.err
    assert main([*base, "--lookup-tree"]) == 0
    out = capsys.readouterr()
    tree = json.loads(out.out)
    assert tree["output_ids"] == ref and tree["config"]["lookup"] == "tree"
    assert all(c["parents"] is not None for c in tree["cycles"] if c["lookup"])
    assert main([*base, "--lookup-tree", "--no-lookup"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "--no-lookup and --lookup-tree" in err[0], err


def test_cli_no_lookup_with_llamacpp_exits_2(dirs, capsys):
    _, root = dirs
    assert main(["generate", "--target", str(root / "target"), "--prompt-ids", "1", "--engine", "llamacpp",
                 "--no-lookup"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "--no-lookup" in err[0], err


def test_bench_compares_lookup_on_and_off(dirs, tmp_path, capsys):
    model, root = dirs
    rows = [{"id": "r", "turns": [" ".join(f"t{i}" for i in _repetitive_prompt(model.config.vocab_size, 2))]}]
    (tmp_path / "rep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    argv = ["bench", "--target", str(root / "target"), "--drafter", str(root / "drafter"), "--dataset",
            f"rep={tmp_path / 'rep.jsonl'}", "--methods", "ar,dflash", "--max-new-tokens", "24", "--no-chat",
            "--out", str(out)]
    assert main([*argv, "--lookup", "on,off,tree"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["methods"] == ["ar", "dflash[lookup]", "dflash[no-lookup]", "dflash[lookup-tree]"]
    assert not s["correctness"]["failed"] and s["variants"]["dflash[lookup-tree]"]["lookup"] == "tree"
    assert s["variants"]["dflash[lookup]"]["lookup"] and not s["variants"]["dflash[no-lookup]"]["lookup"]
    rows = s["results"]["all"]
    assert rows["dflash[lookup]"]["lookup_cycles"] > 0 and rows["dflash[no-lookup]"]["lookup_cycles"] == 0
    capsys.readouterr()
    assert main([*argv[:-1], str(tmp_path / "bad"), "--lookup", "maybe"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "--lookup takes on, off, tree" in err[0], err


def test_lookup_tree_falls_back_to_chains_when_sampling_and_rejects_bad_modes():
    target = tiny_target("qwen3")
    drafter = random_drafter(target, block_size=8)
    prompt = _repetitive_prompt(target.config.vocab_size, 3)
    kw = dict(block_size=8, max_new_tokens=24, temperature=0.8, seed=5)
    on = generate_ids(target, drafter, prompt, **kw)
    tree = generate_ids(target, drafter, prompt, lookup="tree", **kw)
    # trees (and so grafting) run at T=0 only: at T>0 "tree" is plain lookup, the same cycles from the same seed
    assert tree.output_ids == on.output_ids and [c.block for c in tree.cycles] == [c.block for c in on.cycles]
    assert tree.lookup_cycles > 0 and all(c.parents is None for c in tree.cycles)
    with pytest.raises(FlashdraftError, match="lookup must be True, False or 'tree'"):
        generate_ids(target, drafter, prompt, block_size=8, max_new_tokens=4, lookup="graft")
