"""DLoop (looped drafting): lossless at T=0 and T>0, stage accounting, multi-block acceptance, CLI / API / bench."""

import json
import math

import pytest
import torch

from flashdraft import Target, generate
from flashdraft.checkpoint import save_drafter
from flashdraft.cli import main
from flashdraft.decoding.proposers import DrafterPass, LoopProposer, Proposal, stage_confidence
from flashdraft.dflash2 import upgrade_to_dflash2
from flashdraft.errors import FlashdraftError
from flashdraft.sampling_params import SamplingParams
from helpers import hf_greedy, random_drafter, save_tiny_model_dir, tiny_target, tiny_tokenizer
from lossless import assert_greedy_lossless, generate_drafted as generate_ids
from test_cache_alignment import _check
from test_sampling_lossless import ALPHA, NEW, PROMPT, VOCAB, chi2_pvalue, exact_distribution


ALWAYS, NEVER = -math.inf, math.inf  # gates: every later stage runs / none does
LIMIT = 96  # the tiny targets' context, so prompts near it cut stages short


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab - 1, (n,), generator=torch.Generator().manual_seed(seed + n)).tolist()


def _blocks(res):
    return [(c.block, c.accepted, c.emitted) for c in res.cycles]


def expected_stages(start: int, block: int, stages: int, end: int) -> int:
    """With an always-pass gate: as many stages as end before `end` (prompt + max_new_tokens, capped by the context);
    stage 1 always runs, on the official verify_size = min(block, end - start)."""
    n = min(block, end - start) - 1
    return max(s for s in range(1, stages + 1) if s == 1 or start + 1 + s * n <= end)


def stages_per_cycle(cycles, n_prompt: int, block: int, stages: int, end: int) -> list[int]:
    """expected_stages for each cycle of a generation, following the anchor position from cycle to cycle."""
    start, want = n_prompt, []
    for c in cycles:
        want.append(expected_stages(start, block, stages, end))
        start += len(c.emitted)
    return want


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request):
    target = tiny_target(request.param, max_pos=LIMIT)
    return target, random_drafter(target, block_size=8)


@pytest.mark.parametrize("n_prompt", [1, 40, LIMIT - 11])
def test_looped_greedy_equals_target(pair, n_prompt):
    target, drafter = pair
    prompt = _prompt(n_prompt, target.config.vocab_size)
    new = min(24, LIMIT - n_prompt)
    ref = hf_greedy(target, prompt, new)
    for bs in [2, 4, 8]:
        for stages, gate in [(2, ALWAYS), (3, ALWAYS), (3, -0.75)]:
            res = generate_ids(target, drafter, prompt, block_size=bs, max_new_tokens=24, loop_stages=stages,
                               loop_gate=gate)
            assert_greedy_lossless(target, prompt, res.output_ids, ref)
            assert all(len(c.block) <= LIMIT - n_prompt for c in res.cycles)


def test_stage_accounting_and_block_lengths(pair):
    target, drafter = pair
    prompt = _prompt(30, target.config.vocab_size, seed=1)
    ref = hf_greedy(target, prompt, LIMIT - 30)
    plain = generate_ids(target, drafter, prompt, block_size=8, max_new_tokens=80)
    assert plain.output_ids == ref and {c.stages for c in plain.cycles} == {1}
    res = generate_ids(target, drafter, prompt, block_size=8, max_new_tokens=80, loop_stages=3, loop_gate=ALWAYS)
    assert res.output_ids == ref
    start = len(prompt)
    for c in res.cycles:
        b = min(8, LIMIT - start)
        assert c.stages == expected_stages(start, 8, 3, LIMIT)
        assert len(c.block) == 1 + c.stages * (b - 1)
        start += len(c.emitted)
    assert {c.stages for c in res.cycles} == {1, 2, 3}  # all three regimes: free, cut by the context, truncated
    never = generate_ids(target, drafter, prompt, block_size=8, max_new_tokens=80, loop_stages=3, loop_gate=NEVER)
    assert _blocks(never) == _blocks(plain) and [c.stages for c in never.cycles] == [c.stages for c in plain.cycles]
    rec = res.to_record()
    assert [c["stages"] for c in rec["cycles"]] == [c.stages for c in res.cycles]
    assert rec["config"]["loop_stages"] == 3 and rec["config"]["loop_gate"] == ALWAYS
    assert 1 < res.mean_stages < 3


def chain_proposer(target, drafter, params, gen):
    """The drafter's chain made outside the decoder: one stage of b-1 drafts."""
    run = DrafterPass(target, drafter)

    def propose(q, start, b):
        drafts, probs, _ = run.stage(q.draft_cache, q.take_pending()[None], [q.tokens[-1]], start, b - 1, params, gen)
        return Proposal(drafts, probs, stages=1)

    return propose


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_stage_is_plain_dflash(temperature):
    target = tiny_target("llama")
    drafter = random_drafter(target, block_size=4)
    prompt = _prompt(12, target.config.vocab_size)
    kw = dict(block_size=4, max_new_tokens=20, temperature=temperature, seed=3, tree=0)  # DLoop extends the chain
    plain = generate_ids(target, drafter, prompt, **kw)
    assert _blocks(generate_ids(target, drafter, prompt, **kw, loop_stages=1, loop_gate=ALWAYS)) == _blocks(plain)
    assert _blocks(generate_ids(target, drafter, prompt, **kw, loop_stages=4, loop_gate=NEVER)) == _blocks(plain)
    params = SamplingParams(temperature)
    for make in (lambda g: LoopProposer(target, drafter, params, g, 1, ALWAYS),
                 lambda g: chain_proposer(target, drafter, params, g)):
        res = generate_ids(target, drafter, prompt, **kw, propose=make(torch.Generator().manual_seed(4)))
        assert _blocks(res) == _blocks(plain)


def oracle_stages(full: list[int], error_rate: float, seed: int, vocab: int):
    """Stands in for DrafterPass.stage: drafts the target's known greedy tokens (full = prompt + continuation) at each
    stage's positions, corrupted at random, with confident logits so the gate lets later stages run."""
    gen = torch.Generator().manual_seed(seed)

    def stage(self, cache, new_features, inputs, start, n, params, g):
        pos = start + len(inputs)  # the stage's first draft position
        want = full[pos: pos + n]
        drafts = torch.tensor(want + [0] * (n - len(want)))  # past the known continuation: anything
        flip = torch.rand(n, generator=gen) < error_rate
        drafts[flip] = (drafts[flip] + 1 + torch.randint(vocab - 1, (int(flip.sum()),), generator=gen)) % vocab
        logits = torch.full((n, vocab), -20.0)
        logits[torch.arange(n), drafts] = 20.0
        return drafts, None, logits

    return stage


@pytest.mark.parametrize("error_rate", [0.0, 0.1])
def test_one_verify_accepts_more_than_a_block(pair, monkeypatch, error_rate):
    target, drafter = pair
    vocab = target.config.vocab_size
    prompt = _prompt(10, vocab, seed=2)
    ref = hf_greedy(target, prompt, 60)
    monkeypatch.setattr(DrafterPass, "stage", oracle_stages(prompt + ref, error_rate, seed=5, vocab=vocab))
    for bs in [2, 4, 8]:
        res = generate_ids(target, drafter, prompt, block_size=bs, max_new_tokens=60, loop_stages=3, loop_gate=-1.0,
                           state_hook=lambda s: _check(target, None, s))
        assert_greedy_lossless(target, prompt, res.output_ids, ref)
        assert max(c.accepted for c in res.cycles) > bs - 1  # one target pass kept more than one block of drafts
        if error_rate == 0.0:
            assert res.tau > 2 * (bs - 1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_aligned_when_looping(temperature):
    target = tiny_target("qwen3")
    drafter = random_drafter(target, block_size=4)
    prompt = list(range(3, 30))
    with torch.no_grad():
        res = generate_ids(target, drafter, prompt, block_size=4, max_new_tokens=16, temperature=temperature,
                           loop_stages=3, loop_gate=ALWAYS, state_hook=lambda s: _check(target, drafter, s))
    stages = [c.stages for c in res.cycles]
    assert stages == stages_per_cycle(res.cycles, len(prompt), 4, 3, len(prompt) + 16) and 3 in stages


def test_dflash2_loops_and_stays_lossless():
    target = tiny_target("llama")
    d2 = upgrade_to_dflash2(random_drafter(target, block_size=8), conv_group_size=16, selector_rank=8,
                            selector_top_k=4)
    with torch.no_grad():
        for p in d2.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    prompt = _prompt(20, target.config.vocab_size)
    ref = hf_greedy(target, prompt, 24)
    for bs in [2, 8]:
        res = generate_ids(target, d2, prompt, block_size=bs, max_new_tokens=24, loop_stages=3, loop_gate=ALWAYS)
        assert_greedy_lossless(target, prompt, res.output_ids, ref)
        stages = [c.stages for c in res.cycles]
        assert stages == stages_per_cycle(res.cycles, len(prompt), bs, 3, len(prompt) + 24) and 3 in stages
    res = generate_ids(target, d2, prompt, block_size=4, max_new_tokens=12, temperature=1.0, loop_stages=2,
                       loop_gate=ALWAYS)
    assert res.num_new_tokens == 12
    assert [c.stages for c in res.cycles] == stages_per_cycle(res.cycles, len(prompt), 4, 2, len(prompt) + 12)


@pytest.mark.parametrize("is_causal", [None, False])
def test_sliding_window_drafter_loops_losslessly(is_causal):
    """Sliding layers keep their causality and window over the extended block (inference_masks handles any length)."""
    target = tiny_target("qwen3")
    drafter = random_drafter(target, block_size=4, layer_types=["sliding_attention", "full_attention"],
                             sliding_window=3, is_causal=is_causal)
    prompt = _prompt(15, target.config.vocab_size)
    res = generate_ids(target, drafter, prompt, block_size=4, max_new_tokens=16, loop_stages=3, loop_gate=ALWAYS)
    assert_greedy_lossless(target, prompt, res.output_ids, hf_greedy(target, prompt, 16))
    stages = [c.stages for c in res.cycles]
    assert stages == stages_per_cycle(res.cycles, len(prompt), 4, 3, len(prompt) + 16) and 3 in stages


def test_stage_confidence_is_the_drafts_log_probability():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    drafts = torch.tensor([0, 2])
    want = float(torch.log_softmax(logits, -1)[0, 0] + math.log(1 / 3))
    assert stage_confidence(drafts, None, logits) == pytest.approx(want)
    q = torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.2, 0.7]])
    assert stage_confidence(drafts, q, logits) == pytest.approx(math.log(0.5) + math.log(0.7))


@pytest.mark.parametrize("stages,gate", [(0, -0.75), (-1, -0.75), (2, math.nan)])
def test_bad_loop_settings(stages, gate):
    target = tiny_target("llama")
    with pytest.raises(FlashdraftError, match="loop"):
        generate_ids(target, random_drafter(target), [5, 6], max_new_tokens=4, loop_stages=stages, loop_gate=gate)


# ---------------------------------------------------------------- sampling: the joint law of the first tokens

def empirical_looped(target, drafter, params, block_size, stages, gate, n):
    counts, used = {}, {}
    for s in range(n):
        out = generate_ids(target, drafter, PROMPT, block_size=block_size, max_new_tokens=NEW + 3,
                           temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=s,
                           loop_stages=stages, loop_gate=gate)
        first = tuple(out.output_ids[:NEW])  # generated past NEW so that late stages still fit before the end
        counts[first] = counts.get(first, 0) + 1
        for c in out.cycles:
            used[c.stages] = used.get(c.stages, 0) + 1
    return counts, used


def test_looped_sampling_matches_target():
    """Block size 2, up to 3 stages, a gate that stops on roughly half the stages: stopping depends on the drafts."""
    target = tiny_target("llama", vocab=VOCAB, init_std=0.3, seed=3)
    drafter = random_drafter(target, block_size=2, init_std=0.3, seed=4)  # its q is far from the target's p
    params = SamplingParams(1.0)
    counts, used = empirical_looped(target, drafter, params, 2, 3, -1.5, 1500)
    assert len(used) == 3 and min(used.values()) > 50, used  # 1, 2 and 3 stages all occur often
    p = chi2_pvalue(counts, exact_distribution(target, params))
    assert p > ALPHA, f"looped speculative samples do not follow the target distribution (chi2 p={p:.2e})"


# ---------------------------------------------------------------- CLI, API, bench

@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dloop")
    model = save_tiny_model_dir(root / "target", kind="qwen3")
    save_drafter(random_drafter(model, block_size=8), root / "d1")
    d2 = upgrade_to_dflash2(random_drafter(model, block_size=8, seed=7), conv_group_size=16, selector_rank=8,
                            selector_top_k=4)
    save_drafter(d2, root / "d2")
    rows = [{"id": "a", "turns": ["t10 t11 t12 t13 t10 t11"]}, {"id": "b", "turns": ["t20 t21 t22", "t30"]}]
    (root / "tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, root


def test_cli_generate_loops(dirs, capsys):
    model, root = dirs
    prompt = [5, 9, 11, 40, 3]
    code = main(["generate", "--target", str(root / "target"), "--drafter", str(root / "d1"), "--prompt-ids",
                 ",".join(map(str, prompt)), "--max-new-tokens", "20", "--loop-stages", "2", "--loop-gate", "-inf",
                 "--json", "--no-lookup"])
    out = capsys.readouterr()
    assert code == 0, out.err
    rec = json.loads(out.out)
    assert rec["output_ids"] == hf_greedy(model, prompt, 20)
    start, end = len(prompt), len(prompt) + 20
    for c in rec["cycles"]:  # two stages while they end before the end, then one, shrinking to the tokens owed
        stages, b = expected_stages(start, 8, 2, end), min(8, end - start)
        assert c["stages"] == stages and len(c["block"]) == 1 + stages * (b - 1)
        start += c["accepted"] + 1
    assert rec["cycles"][0]["stages"] == 2 and len(rec["cycles"][0]["block"]) == 15
    assert rec["config"]["loop_stages"] == 2 and rec["config"]["loop_gate"] == -math.inf
    mean = sum(c["stages"] for c in rec["cycles"]) / len(rec["cycles"])
    assert f"{mean:.2f} of up to 2 drafting stages per cycle" in out.err


@pytest.mark.parametrize("extra,match", [(["--loop-stages", "0"], "loop stages must be"),
                                         (["--loop-gate", "nan"], "loop gate must be")])
def test_cli_bad_loop_settings_exit_2(dirs, capsys, extra, match):
    _, root = dirs
    assert main(["generate", "--target", str(root / "target"), "--prompt-ids", "1", *extra]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("flashdraft: error:") and match in err[0], err


def test_api_generate_loops(dirs):
    model, root = dirs
    from flashdraft.checkpoint import load_drafter

    target = Target(model, tiny_tokenizer(model.config.vocab_size), "tiny")
    res = generate(target, load_drafter(root / "d1"), [4, 5, 6], block_size=4, max_new_tokens=12, loop_stages=3,
                   loop_gate=ALWAYS, lookup=False)
    assert res.output_ids == hf_greedy(model, [4, 5, 6], 12)
    assert [c.stages for c in res.cycles] == stages_per_cycle(res.cycles, 3, 4, 3, 15) and res.mean_stages > 1
    assert res.config["loop_stages"] == 3


def test_bench_sweeps_loops_and_drafter_kinds(dirs, tmp_path, capsys):
    _, root = dirs
    out = tmp_path / "run"
    base = ["bench", "--target", str(root / "target"), "--drafter", str(root / "d1"), "--drafter", str(root / "d2"),
            "--dataset", f"tiny={root / 'tiny.jsonl'}", "--methods", "ar,dflash", "--max-new-tokens", "24",
            "--lookup", "off", "--out", str(out)]
    assert main([*base, "--loop-stages", "1,3", "--loop-gate", "-inf,-0.75"]) == 0
    s = json.loads((out / "summary.json").read_text())
    labels = ["ar"] + [f"{k}[{d},b8{loop},no-lookup]" for k, d in [("dflash", "d1"), ("dflash2", "d2")]
                       for loop in ["", ",s3,g-inf", ",s3,g-0.75"]]
    assert s["methods"] == labels and not s["correctness"]["failed"]
    assert s["correctness"]["mismatches"] == {m: 0 for m in labels[1:]}
    rows = s["results"]["all"]
    for m in labels[1:]:
        r = rows[m]
        assert sum(r["stages_hist"].values()) == r["cycles"] > 0
        if ",s3," not in m:
            assert r["stages_hist"] == {"1": r["cycles"]} and r["mean_stages"] == 1.0
        if "g-inf" in m:  # three stages while they end before the end of the generation, fewer in the last cycles
            assert "3" in r["stages_hist"] and r["mean_stages"] > 1
    assert rows["ar"]["mean_stages"] is None and rows["ar"]["stages_hist"] == {}
    assert s["variants"]["dflash2[d2,b8,s3,g-0.75,no-lookup]"] | {"drafter": None} == {
        "method": "dflash", "drafter": None, "kind": "dflash2", "block_size": 8, "lookup": False, "tree": 0,
        "loop_stages": 3, "loop_gate": -0.75}
    plain = s["variants"]["dflash[d1,b8,no-lookup]"]
    assert plain["kind"] == "dflash" and "loop_stages" not in plain
    recs = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    for r in recs:
        for t in r["turns"]:
            assert len(t["stages"]) == (0 if r["method"] == "ar" else len(t["acceptance_lengths"]))
    md = (out / "report.md").read_text()
    assert "| stages |" in md and "drafting stages per cycle: mean" in md
    capsys.readouterr()
    assert main([*base, "--loop-stages", "0"]) == 2
    assert main([*base, "--loop-stages", "1,x"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 2 and all(ln.startswith("flashdraft: error:") for ln in err), err
