"""Draft trees: building, masking, acceptance, cache compaction, and greedy decoding that stays lossless (fp32)."""

import json

import pytest
import torch

from flashdraft import target as T
from flashdraft.checkpoint import save_drafter
from flashdraft.cli import main
from flashdraft.decoding import Proposal, generate_ids
from flashdraft.dflash2 import upgrade_to_dflash2
from flashdraft.target import ancestors
from flashdraft.tree import accept_tree_greedy, best_first_tree, graft_chain, node_depths
from helpers import hf_greedy, random_drafter, save_tiny_model_dir, tiny_target
from lossless import assert_greedy_lossless


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab - 1, (n,), generator=torch.Generator().manual_seed(seed + n)).tolist()


def test_best_first_tree_takes_the_likeliest_paths():
    """Children 0.6 / 0.3 / 0.1 everywhere: nodes come in order of path probability, within depth and budget."""
    lp = torch.tensor([0.6, 0.3, 0.1]).log()
    children = lambda d, prev: (lp, torch.tensor([10 * (d + 1) + 1, 10 * (d + 1) + 2, 10 * (d + 1) + 3]))
    tokens, parents = best_first_tree(children, anchor=0, depth=3, budget=5)
    # 0.6 (11), 0.36 (11→21), 0.3 (12), 0.216 (11→21→31), 0.18 (11→22 and 12→21 tie: the first pushed wins)
    assert tokens == [11, 21, 12, 31, 22]
    assert parents == [-1, 0, -1, 1, 0]
    assert node_depths(parents) == [1, 2, 1, 3, 2]
    deep, _ = best_first_tree(children, anchor=0, depth=1, budget=5)
    assert deep == [11, 12, 13]  # depth 1 holds only three children: the budget is not reached
    assert best_first_tree(children, anchor=0, depth=3, budget=0) == ([], [])


def test_ancestors_and_acceptance():
    parents = [-1, 0, -1, 2, 2]  # anchor → {a, c}; a → b; c → {d, e}
    see = ancestors(parents)
    assert see.tolist() == [[1, 0, 0, 0, 0, 0],
                            [1, 1, 0, 0, 0, 0],
                            [1, 1, 1, 0, 0, 0],
                            [1, 0, 0, 1, 0, 0],
                            [1, 0, 0, 1, 1, 0],
                            [1, 0, 0, 1, 0, 1]]
    tokens = [5, 6, 7, 8, 9]
    # rows: anchor, then one per node; the target says 7 after the anchor, 9 after node c, 4 after node e
    assert accept_tree_greedy(tokens, parents, [7, 0, 0, 9, 0, 4]) == ([2, 4], 4)
    assert accept_tree_greedy(tokens, parents, [5, 6, 3, 0, 0, 0]) == ([0, 1], 3)
    assert accept_tree_greedy(tokens, parents, [1, 0, 0, 0, 0, 0]) == ([], 1)
    assert accept_tree_greedy(tokens, parents, [8, 0, 0, 0, 0, 0]) == ([], 8)  # 8 exists, but not under the anchor


def test_graft_chain_shares_existing_nodes():
    tokens, parents = [5, 6, 7, 8], [-1, 0, -1, 2]  # anchor → {5 → 6, 7 → 8}
    assert graft_chain(tokens, parents, [7, 8, 9, 4]) == ([5, 6, 7, 8, 9, 4], [-1, 0, -1, 2, 3, 4])
    assert graft_chain(tokens, parents, [6, 5]) == ([5, 6, 7, 8, 6, 5], [-1, 0, -1, 2, -1, 4])  # 6 is not a root
    assert graft_chain(tokens, parents, [5, 6]) == (tokens, parents)  # already a path: nothing to verify twice
    assert graft_chain(tokens, parents, []) == (tokens, parents)
    assert graft_chain([], [], [3, 3]) == ([3, 3], [-1, 0])
    t, p = graft_chain(tokens, parents, [7, 2])
    assert accept_tree_greedy(t, p, [7, 0, 0, 2, 0, 1]) == ([2, 4], 1)  # the grafted path is accepted like any other
    assert tokens == [5, 6, 7, 8] and parents == [-1, 0, -1, 2]  # the inputs are left as they were


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tree_forward_equals_each_path_as_a_chain_and_compacts_the_cache(kind):
    """Every node's logits are those of its root path run as a chain; keep_rows leaves the cache of that path."""
    model = tiny_target(kind)
    T.use_grouped_sdpa(model)
    ctx = _prompt(30, model.config.vocab_size)
    tokens, parents = [11, 12, 13, 14, 15, 16], [-1, 0, -1, 2, 3, 2]
    anchor, start = 7, len(ctx)

    def fresh():
        cache = T.new_cache(model)
        T.forward(model, torch.tensor(ctx), 0, cache, [])
        return cache

    cache = fresh()
    tree = T.forward(model, torch.tensor([anchor] + tokens), start, cache, [0, 2], parents=parents)
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        chain = T.forward(model, torch.tensor([anchor] + [tokens[p] for p in path]), start, fresh(), [0, 2])
        rows = [0] + [p + 1 for p in path]
        torch.testing.assert_close(tree.logits[rows], chain.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(tree.features[rows], chain.features, atol=1e-4, rtol=1e-4)
    path = [2, 3, 4]  # c → d → e: rows 3, 4, 5 move to positions start+1..start+3
    T.keep_rows(cache, start, [0, 3, 4, 5])
    assert cache.get_seq_length() == start + 4
    nxt = T.forward(model, torch.tensor([21, 22]), start + 4, cache, [])
    ref = T.forward(model, torch.tensor([anchor] + [tokens[p] for p in path] + [21, 22]), start, fresh(), [])
    torch.testing.assert_close(nxt.logits, ref.logits[-2:], atol=1e-4, rtol=1e-4)


def oracle_tree_proposer(reference: list[int], error_rate: float, seed: int, vocab: int, taken: list):
    """Random trees where one random root path follows the target's greedy continuation (corrupted at random) and
    the other nodes are wrong siblings: acceptance takes non-contiguous rows, which keep_rows must compact."""
    gen = torch.Generator().manual_seed(seed)

    def rand(n: int) -> int:
        return int(torch.randint(n, (1,), generator=gen))

    def propose(state, start, b):
        taken.append(state.take_pending())
        emitted = len(state.tokens) - state.num_prompt_tokens
        want = reference[emitted: emitted + b - 1]
        tokens, parents, parent = [], [], -1
        for d, good in enumerate(want):
            for _ in range(rand(3)):  # wrong siblings before the right one
                tokens.append((good + 1 + rand(vocab - 1)) % vocab)
                parents.append(parent)
            wrong = float(torch.rand(1, generator=gen)) < error_rate
            tokens.append((good + 1) % vocab if wrong else good)
            parents.append(parent)
            parent = len(tokens) - 1
            for _ in range(rand(2) if d + 2 < len(want) else 0):  # wrong children off the path, within the block
                tokens.append((want[d + 1] + 1 + rand(vocab - 1)) % vocab)
                parents.append(parent)
        return Proposal(torch.tensor(tokens, dtype=torch.long), parents=parents, stages=1)

    return propose


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("error_rate", [0.0, 0.2, 0.6])
def test_oracle_trees_are_lossless_and_feed_the_drafter_the_right_features(kind, error_rate):
    model = tiny_target(kind)
    vocab = model.config.vocab_size
    layer_ids = [0, 2]
    for n_prompt, bs in [(1, 2), (9, 4), (40, 8), (60, 16)]:
        prompt = _prompt(n_prompt, vocab, seed=3)
        ref = hf_greedy(model, prompt, 40)
        taken: list = []
        res = generate_ids(model, None, prompt, block_size=bs, max_new_tokens=40, layer_ids=layer_ids,
                           propose=oracle_tree_proposer(ref, error_rate, bs, vocab, taken), lookup=False)
        cycles, out = res.cycles, res.output_ids
        assert_greedy_lossless(model, prompt, out, ref)
        trees = [c for c in cycles if c.parents is not None]
        assert len(trees) >= len(cycles) - 1  # all but a last one-token cycle
        if error_rate == 0.0:
            assert all(c.accepted == max(node_depths(c.parents)) for c in trees)
        if error_rate < 0.5 and bs >= 4:
            assert any(c.accepted > 0 and c.parents != list(range(-1, len(c.parents) - 1)) for c in trees)
        # the drafter's context saw the target's features of exactly the committed tokens, in order
        feats = torch.cat([f for f in taken if f is not None])
        full = T.forward(model, torch.tensor(prompt + out[:-1]), 0, T.new_cache(model), layer_ids).features
        torch.testing.assert_close(feats, full[: len(feats)], atol=1e-4, rtol=1e-4)
        assert len(feats) >= len(full) - bs


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("dflash2", [False, True])
def test_drafter_trees_equal_the_target(kind, dflash2):
    """The drafter's own trees (DFlash 1: top children; DFlash 2: selector-scored) keep the greedy output."""
    target = tiny_target(kind)
    drafter = random_drafter(target, block_size=8)
    if dflash2:
        drafter = upgrade_to_dflash2(drafter)
        with torch.no_grad():
            drafter.candidate_selector.hidden_projection.weight.normal_(0, 0.2)  # a live pair term
    for seed in range(2):
        prompt = _prompt(12 + seed, target.config.vocab_size, seed=seed)
        ref = hf_greedy(target, prompt, 40)
        for bs, tree in [(2, 3), (4, 6), (8, 7), (8, 15)]:
            res = generate_ids(target, drafter, prompt, block_size=bs, max_new_tokens=40, tree=tree, lookup=False)
            assert_greedy_lossless(target, prompt, res.output_ids, ref)
            assert res.config["tree"] == tree
            drafted = [c for c in res.cycles if len(c.block) > 1]  # a last cycle may have room for one token only
            assert drafted and all(c.parents is not None and len(c.block) == 1 + len(c.parents) for c in drafted)
            assert all(len(c.parents) <= tree and max(node_depths(c.parents)) <= bs - 1 for c in drafted)


@pytest.mark.parametrize("dflash2", [False, True])
def test_a_one_wide_tree_is_the_chain(dflash2):
    """Width 1 and budget b-1: the tree is the drafter's own chain (argmax, or the DFlash 2 greedy walk)."""
    from flashdraft.decoding.proposers import DrafterPass, tree_from_pass

    target = tiny_target("llama")
    drafter = random_drafter(target, block_size=8)
    if dflash2:
        drafter = upgrade_to_dflash2(drafter)
        with torch.no_grad():
            drafter.candidate_selector.hidden_projection.weight.normal_(0, 0.2)
    prompt = _prompt(20, target.config.vocab_size, seed=5)
    chain = generate_ids(target, drafter, prompt, block_size=8, max_new_tokens=30, tree=0, lookup=False).cycles
    run = DrafterPass(target, drafter)

    def one_wide_tree(q, start, b):  # the drafter's tree made outside the decoder, one child per node
        hidden, logits = run(q.draft_cache, q.take_pending()[None], [q.tokens[-1]], start, b - 1)
        return tree_from_pass(drafter, hidden[-(b - 1):], logits, q.tokens[-1], budget=b - 1, width=1)

    tree = generate_ids(target, drafter, prompt, block_size=8, max_new_tokens=30, lookup=False,
                        propose=one_wide_tree).cycles
    assert all(c.parents is not None for c in tree if len(c.block) > 1)
    assert [(c.block, c.accepted) for c in tree] == [(c.block, c.accepted) for c in chain]


def test_trees_fall_back_to_the_chain_where_they_cannot_run():
    """At T > 0, and on a target whose cache cannot compact a path (sliding window), cycles are chains."""
    from transformers import MistralConfig, MistralForCausalLM

    target = tiny_target("llama")
    drafter = random_drafter(target, block_size=4)
    prompt = _prompt(10, target.config.vocab_size)
    res = generate_ids(target, drafter, prompt, block_size=4, max_new_tokens=20, tree=6, temperature=1.0)
    assert res.config["tree"] == 0 and all(c.parents is None for c in res.cycles)
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8, initializer_range=0.2)
    sliding = MistralForCausalLM(cfg).float().eval()
    sliding.generation_config.eos_token_id = None
    sliding.generation_config.pad_token_id = 0
    d2 = random_drafter(sliding, block_size=4)
    ref = hf_greedy(sliding, prompt, 30)
    res = generate_ids(sliding, d2, prompt, block_size=4, max_new_tokens=30, tree=6, lookup=False)
    assert_greedy_lossless(sliding, prompt, res.output_ids, ref)
    assert all(c.parents is None for c in res.cycles) and res.config["tree"] == 0  # the record says so too


@pytest.mark.parametrize("kw,msg", [
    (dict(tree=-1), "tree must be a node count"),
    (dict(tree=4, loop_stages=2), "do not combine"),
    (dict(tree=4, propose=lambda s, a, b: (torch.zeros(0, dtype=torch.long), None)), "drop `propose`"),
])
def test_bad_tree_settings(kw, msg):
    from flashdraft.errors import FlashdraftError

    target = tiny_target("llama")
    with pytest.raises(FlashdraftError, match=msg):
        generate_ids(target, random_drafter(target, block_size=4), [5, 6], max_new_tokens=4, **kw)


def test_cli_tree(tmp_path, capsys):
    target = save_tiny_model_dir(tmp_path / "t")
    d = tmp_path / "d"
    save_drafter(random_drafter(target, block_size=8), d)
    base = ["generate", "--target", str(tmp_path / "t"), "--drafter", str(d), "--prompt-ids", "5,6,7,8,9",
            "--max-new-tokens", "24", "--no-lookup"]
    assert main(base + ["--tree", "7", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["config"]["tree"] == 7
    assert all(c["parents"] is not None and len(c["block"]) == 1 + len(c["parents"]) for c in rec["cycles"])
    assert rec["output_ids"] == hf_greedy(target, [5, 6, 7, 8, 9], 24)
    assert main(base + ["--tree", "5"]) == 0
    assert "tree 5" in capsys.readouterr().err
    for bad, msg in [(["--tree", "-2"], "node count"), (["--tree", "3", "--loop-stages", "2"], "do not combine"),
                     (["--tree", "3", "--engine", "llamacpp"], "--tree is for --engine torch")]:
        assert main([a for a in base if a != "--no-lookup"] + bad) == 2
        assert msg in capsys.readouterr().err


def test_bench_sweeps_trees(tmp_path, capsys):
    target = save_tiny_model_dir(tmp_path / "t")
    save_drafter(random_drafter(target, block_size=4), tmp_path / "d")
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "p", "turns": ["t5 t9 t11 t40 t3"]}) + "\n")
    argv = ["bench", "--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"), "--dataset",
            f"p={tmp_path / 'p.jsonl'}", "--methods", "ar,dflash", "--max-new-tokens", "24", "--no-chat",
            "--lookup", "off"]
    assert main([*argv, "--tree", "0,5", "--out", str(tmp_path / "run")]) == 0
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["methods"] == ["ar", "dflash[no-lookup,chain]", "dflash[no-lookup,tree5]"]
    assert not s["correctness"]["failed"] and s["correctness"]["mismatches"] == {m: 0 for m in s["methods"][1:]}
    assert [s["variants"][m]["tree"] for m in s["methods"][1:]] == [0, 5]
    recs = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    lengths = {r["method"]: [a for t in r["turns"] for a in t["acceptance_lengths"]] for r in recs}
    assert set(lengths) == set(s["methods"]) and all(lengths[m] for m in s["methods"][1:])
    capsys.readouterr()
    for bad, msg in [(["--tree", "x"], "--tree must be comma-separated int"), (["--tree", "-1"], "node counts >= 0"),
                     (["--tree", "3", "--loop-stages", "2"], "do not combine")]:
        assert main([*argv, *bad, "--out", str(tmp_path / "bad")]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and msg in err[0], err
