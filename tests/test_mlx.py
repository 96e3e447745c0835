"""The MLX engine (marked mlx: needs `make mlx`, and fails without it).

- lossless: MLX DFlash (DFlash 1 and 2, with and without prompt lookup) reproduces MLX plain greedy, which reproduces
  the torch target's own greedy decoding (fp32), on tiny models built in code and on the real target;
- the MLX drafter's logits equal the torch drafter's on the same inputs (fp32, within LOGIT_ATOL);
- speculative sampling on MLX follows the target's distribution (chi-square), and a verifier that keeps every draft
  fails the same test;
- the command line: `generate --engine mlx` records, the `mlx` / `mlx-dflash` bench methods, one-line refusals.
"""

import builtins
import json
import sys

import numpy as np
import pytest
import torch

from flashdraft.checkpoint import save_drafter
from flashdraft.cli import main
from flashdraft.decoding import generate_ids
from flashdraft.decoding.settings import DecodeSettings
from flashdraft.errors import FlashdraftError
from flashdraft.sampling_params import SamplingParams
from helpers import hf_greedy, random_drafter, save_tiny_model_dir, tiny_target
from lossless import assert_greedy_lossless

pytestmark = pytest.mark.mlx

LOGIT_ATOL = 1e-4  # fp32: MLX and torch kernels sum in different orders; logits of these models are O(1-10)


@pytest.fixture(scope="module", autouse=True)
def require():
    from flashdraft.mlx import require_mlx

    require_mlx()  # a missing MLX fails every test here with the fix in the message


def mlx_models(root, kind: str, arch: str = "dflash", **kw):
    """A tiny target saved as a Hugging Face directory, loaded in torch and in MLX, and a random drafter of `arch` in
    both."""
    from flashdraft.mlx.drafter import from_torch
    from flashdraft.mlx.target import load_mlx_target

    model = save_tiny_model_dir(root / kind, kind, **kw)
    extra = {"arch": "dflash2", "selector_rank": 16, "selector_top_k": 4} if arch == "dflash2" else {}
    drafter = random_drafter(model, block_size=6, **extra)
    return model, drafter, load_mlx_target(str(root / kind), "float32"), from_torch(drafter)


@pytest.fixture(scope="module", params=[("llama", "dflash"), ("qwen3", "dflash2")], ids=["llama-dflash",
                                                                                         "qwen3-dflash2"])
def tiny(request, tmp_path_factory):
    kind, arch = request.param
    return mlx_models(tmp_path_factory.mktemp("mlx"), kind, arch)


def decode(mlx_target, drafter, prompt, vocab, **kw):
    from flashdraft.mlx.decode import mlx_generate_ids

    s = DecodeSettings(**{"max_new_tokens": 40, "lookup": False, "stop_token_ids": (), "tree": 0, **kw})
    return mlx_generate_ids(mlx_target, drafter, prompt, s.resolve(drafter.config.block_size if drafter else None),
                      vocab, 512)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 40, 3, 40, 3, 40, 3], [1, 2]]


@pytest.mark.parametrize("lookup", [False, True])
def test_mlx_greedy_is_lossless_on_tiny_models(tiny, lookup):
    model, drafter, mt, md = tiny
    for prompt in PROMPTS:
        ref = hf_greedy(model, prompt, 40)
        plain = decode(mt, None, prompt, 96, block_size=1)
        assert_greedy_lossless(model, prompt, plain.output_ids, ref)  # MLX plain = torch greedy
        spec = decode(mt, md, prompt, 96, lookup=lookup)
        assert spec.output_ids == plain.output_ids  # MLX DFlash = MLX plain, token for token
        # the same drafter drafts the same blocks in torch: cycle for cycle, the same drafts are kept
        ref = generate_ids(model, drafter, prompt, max_new_tokens=40, lookup=lookup, stop_token_ids=(), tree=0)
        assert spec.acceptance_lengths == ref.acceptance_lengths and len(spec.cycles) == len(ref.cycles)
        rec = spec.to_record()
        assert rec["config"]["block_size"] == 6 and rec["config"]["tree"] == 0 and sum(
            len(c["block"]) > 1 for c in rec["cycles"]) == len(rec["cycles"])


def test_partial_acceptance_trims_the_caches_exactly(tiny, monkeypatch):
    """Drafts that follow the known greedy continuation, corrupted at random: every cycle keeps a different prefix,
    so the target cache and the drafter's features are trimmed at every offset."""
    import mlx.core as mxc

    from flashdraft.mlx import decode as D

    model, _, mt, md = tiny
    prompt = PROMPTS[0]
    ref = decode(mt, None, prompt, 96, block_size=1, max_new_tokens=60).output_ids
    gen = torch.Generator().manual_seed(0)
    real = D.MlxSession._propose

    def oracle(self, start, b):
        if torch.rand(1, generator=gen) < 0.3:
            return real(self, start, b)  # the drafter itself, on the caches the oracle cycles left behind
        emitted = len(self.tokens) - self.request.num_prompt_tokens
        want = (ref[emitted: emitted + b - 1] + [0] * b)[: b - 1]
        want = [t if torch.rand(1, generator=gen) > 0.15 else (t + 1) % 96 for t in want]
        self.pending, feats = None, self.pending  # the drafter's context still takes the committed features
        if feats is not None:
            self.draft_cache.extend(md.context_kv(feats[None], self.draft_cache.length))
        return mxc.array(want, dtype=mxc.int32), None, 1, False

    monkeypatch.setattr(D.MlxSession, "_propose", oracle)
    out = decode(mt, md, prompt, 96, max_new_tokens=60)
    assert out.output_ids == ref
    kept = [c.accepted for c in out.cycles]
    assert len(set(kept)) >= 3 and max(kept) >= 3, kept  # several different prefixes were kept


def test_mlx_drafter_logits_equal_torch(tiny):
    """Same features, same block, same positions: the drafter's proposal logits in MLX and in torch."""
    import mlx.core as mxc

    from flashdraft import target as T
    from flashdraft.drafter import ContextCache, draft_block
    from flashdraft.mlx.drafter import MlxContextCache as MxCache
    from flashdraft.mlx.drafter import draft

    model, drafter, mt, md = tiny
    ids = list(range(3, 23))
    with torch.no_grad():
        out = T.forward(model, torch.tensor(ids), 0, T.new_cache(model), drafter.config.target_layer_ids)
        block = torch.tensor([ids[-1]] + [drafter.config.mask_token_id] * 5)
        emb = T.embed(model)(block)[None]
        want = draft_block(drafter, ContextCache(), out.features[None], emb, len(ids), T.lm_head(model))
    _, feats = mt.forward(ids, mt.new_cache(), drafter.config.target_layer_ids)
    assert torch.allclose(torch.from_numpy(np.array(feats)), out.features, atol=LOGIT_ATOL)
    _, got = draft(md, MxCache(), feats, mt.embed(mxc.array(block.tolist()))[None], len(ids), mt.head_weight(), 5)
    got = torch.from_numpy(np.array(got))
    assert got.shape == want.shape
    assert (got - want).abs().max() < LOGIT_ATOL, float((got - want).abs().max())
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_only_the_layers_the_drafter_reads_are_kept(tiny):
    """The target keeps the outputs of the drafter's layers only (each kept output holds a forward's activations)."""
    from flashdraft.mlx.target import Capture

    model, drafter, mt, md = tiny
    decode(mt, md, PROMPTS[0], 96, max_new_tokens=8)
    wanted = set(drafter.config.target_layer_ids)
    assert set(mt.slots) == wanted and len(wanted) < len(mt.inner.layers)
    assert {i for i, layer in enumerate(mt.inner.layers) if isinstance(layer, Capture)} == wanted
    with pytest.raises(FlashdraftError, match=r"reads target layers \[9\]; the target has 4"):
        mt.capture([9])


def test_a_target_whose_cache_cannot_trim_is_refused_in_one_line(tmp_path, monkeypatch):
    """Rejected drafts are rolled back by trimming the cache: a recurrent (ArraysCache) or sliding-window
    (RotatingKVCache) layer cannot be, and such a target is refused when it loads, not mid-generation."""
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    from flashdraft.mlx import target as MT

    save_tiny_model_dir(tmp_path / "m", "llama")
    for cache, kind in ([KVCache(), ArraysCache(2)], "ArraysCache"), ([KVCache(), RotatingKVCache(64)],
                                                                        "RotatingKVCache"):
        monkeypatch.setattr(MT, "make_prompt_cache", lambda model, c=cache: c)
        with pytest.raises(FlashdraftError) as e:
            MT.load_mlx_target.__wrapped__(str(tmp_path / "m"), "float32")
        msg = str(e.value)
        assert "\n" not in msg and kind in msg and "--engine torch" in msg and "cannot roll back" in msg
    with pytest.raises(FlashdraftError, match="could not drop 3 rejected positions"):
        MT.trim([ArraysCache(2)], 3)


def test_mlx_dflash2_walk_equals_torch(tmp_path):
    import mlx.core as mxc

    from flashdraft.mlx.drafter import from_torch

    model = tiny_target("qwen3")
    drafter = random_drafter(model, block_size=6, arch="dflash2", selector_rank=16, selector_top_k=4)
    md = from_torch(drafter)
    gen = torch.Generator().manual_seed(0)
    hidden, logits = torch.randn(5, 64, generator=gen), torch.randn(5, 96, generator=gen) * 3
    want, _ = drafter.candidate_selector.walk(hidden, logits, 7, 0.0, None)
    got, _ = md.candidate_selector.walk(mxc.array(hidden.numpy()), mxc.array(logits.numpy()), 7, 0.0, None)
    assert np.array(got).tolist() == want.tolist()


# ---------------------------------------------------------------- sampling

@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    """The chi-square test's models (test_sampling_lossless.py): vocabulary 8, drafters whose q is far from p (DFlash 2:
    its walk picks among each position's top 4 of 8 tokens)."""
    from flashdraft.mlx.drafter import from_torch
    from flashdraft.mlx.target import load_mlx_target

    root = tmp_path_factory.mktemp("mlx8")
    target = tiny_target("llama", vocab=8, init_std=0.3, seed=3)
    target.save_pretrained(root)
    drafters = {"dflash": random_drafter(target, init_std=0.3, seed=4),
                "dflash2": random_drafter(target, init_std=0.3, seed=4, arch="dflash2", selector_rank=8,
                                          selector_top_k=4)}
    return target, load_mlx_target(str(root), "float32"), {k: from_torch(d) for k, d in drafters.items()}


def mlx_counts(mt, md, params: SamplingParams, block_size: int, n: int, prompt, lookup=False) -> dict[tuple, int]:
    from test_sampling_lossless import NEW

    counts: dict[tuple, int] = {}
    for seed in range(n):
        out = decode(mt, md, prompt, 8, block_size=block_size, max_new_tokens=NEW, temperature=params.temperature,
                     top_k=params.top_k, top_p=params.top_p, seed=seed, lookup=lookup)
        counts[tuple(out.output_ids)] = counts.get(tuple(out.output_ids), 0) + 1
    return counts


@pytest.mark.parametrize("arch,params,block_size", [("dflash", SamplingParams(1.0), 3),
                                                    ("dflash", SamplingParams(0.8, top_k=5, top_p=0.9), 2),
                                                    ("dflash2", SamplingParams(1.0), 3)])
def test_mlx_speculative_sampling_matches_target(tiny8, arch, params, block_size):
    from test_sampling_lossless import ALPHA, PROMPT, chi2_pvalue, exact_distribution

    target, mt, drafters = tiny8
    p = chi2_pvalue(mlx_counts(mt, drafters[arch], params, block_size, 1500, PROMPT),
                    exact_distribution(target, params))
    assert p > ALPHA, f"MLX speculative samples do not follow the target distribution (chi2 p={p:.2e})"


def test_mlx_accept_all_verifier_fails_the_same_test(tiny8, monkeypatch):
    """The negative control: a verifier that keeps every draft is caught."""
    from flashdraft.mlx import decode as D
    from test_sampling_lossless import ALPHA, PROMPT, accept_all, chi2_pvalue, exact_distribution

    monkeypatch.setattr(D, "accept_sampling", accept_all)
    target, mt, drafters = tiny8
    params = SamplingParams(1.0)
    counts = mlx_counts(mt, drafters["dflash"], params, 3, 1500, PROMPT)
    exact = exact_distribution(target, params)
    assert any(exact.get(k, 0) == 0 for k in counts) or chi2_pvalue(counts, exact) < ALPHA


# ---------------------------------------------------------------- command line

@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlxcli")
    model = save_tiny_model_dir(root / "target", kind="qwen3")
    save_drafter(random_drafter(model, block_size=8), root / "drafter")
    rows = [{"id": "a", "turns": ["t10 t11 t12 t13 t10 t11 t12"]}, {"id": "b", "turns": ["t20 t21", "t30 t31"]}]
    (root / "tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_mlx_without_a_drafter_says_it_decodes_plainly(dirs, capsys):
    from flashdraft.engines.mlx import MlxEngine
    from flashdraft.models import load_target

    engine = MlxEngine.open(load_target(str(dirs / "target")))
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert engine.drafter is None and len(lines) == 1 and "no drafter registered" in lines[0]
    assert "decodes plainly" in lines[0] and "--drafter DIR" in lines[0]
    MlxEngine.open(load_target(str(dirs / "target")), plain=True)  # asked for: no notice
    assert capsys.readouterr().err.strip() == ""


def test_generate_engine_mlx_record_matches_torch_shape(dirs, capsys):
    base = ["generate", "t5 t6 t7", "--target", str(dirs / "target"), "--drafter", str(dirs / "drafter"),
            "--max-new-tokens", "12", "--json", "--stop-token-ids", ""]
    assert main([*base, "--engine", "mlx", "--compare-ar"]) == 0
    out, err = capsys.readouterr()
    rec = json.loads(out)
    assert main([*base, "--tree", "0"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert set(rec) - {"compare_ar"} == set(ref) and rec["output_ids"] == ref["output_ids"]
    assert set(rec["cycles"][0]) == set(ref["cycles"][0]) and rec["compare_ar"]["identical"]
    assert "MLX" in err


@pytest.mark.parametrize("extra,match", [(["--tree", "7"], "--tree is for --engine torch"),
                                         (["--loop-stages", "2"], "DLoop"),
                                         (["--lookup", "tree"], "--lookup tree")])
def test_mlx_refusals_are_one_line(dirs, capsys, extra, match):
    assert main(["generate", "t5", "--target", str(dirs / "target"), "--engine", "mlx", *extra]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1 and match in lines[0], lines


@pytest.mark.parametrize("where", ["/no/such/dir", "no-such-owner/no-such-model", "bad id!"])
def test_target_not_local_is_refused_in_one_line(where):
    from flashdraft.mlx.target import load_mlx_target

    with pytest.raises(FlashdraftError, match="local Hugging Face directory") as e:
        load_mlx_target(where, "float32")
    assert "\n" not in str(e.value)


def test_missing_mlx_is_one_line_with_the_fix(dirs, capsys, monkeypatch):
    real = builtins.__import__

    def no_mlx(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.split(".")[0] in ("mlx", "mlx_lm"):
            raise ImportError(f"No module named {name!r}", name=name)
        return real(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_mlx)
    for m in [m for m in sys.modules if m.startswith("mlx")]:
        monkeypatch.delitem(sys.modules, m)
    with pytest.raises(FlashdraftError, match="make mlx"):
        from flashdraft.mlx import require_mlx

        require_mlx()
    assert main(["generate", "t5", "--target", str(dirs / "target"), "--engine", "mlx"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "make mlx" in err[0], err


def test_bench_mlx_methods_are_lossless(dirs, tmp_path):
    out = tmp_path / "run"
    assert main(["bench", "--target", str(dirs / "target"), "--drafter", str(dirs / "drafter"), "--dataset",
                 f"tiny={dirs / 'tiny.jsonl'}", "--methods", "mlx,mlx-dflash,dflash", "--block-size", "4",
                 "--lookup", "off", "--tree", "0", "--max-new-tokens", "10", "--out", str(out), "--profile",
                 "--profile-tokens", "6"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["correctness"]["checked"] and not s["correctness"]["failed"]
    rows = s["results"]["all"]
    mlx_row = next(v for k, v in rows.items() if k.startswith("mlx-dflash"))
    torch_row = next(v for k, v in rows.items() if k.startswith("dflash"))
    assert mlx_row["baseline"] == "mlx" and mlx_row["tau"] == pytest.approx(torch_row["tau"], rel=0.05)
    prof = next(p for p in json.loads((out / "profile.json").read_text())["profiles"] if p["label"].startswith("mlx"))
    assert prof["engine"] == "mlx (float32)" and prof["plain_ms"] > 0 and sorted(map(int, prof["draft_ms"])) == list(range(2, 9))
    assert all(v > 0 for v in [*prof["draft_ms"].values(), *prof["verify_ms"].values(), *prof["break_even"].values()])


# ---------------------------------------------------------------- the real target

@pytest.mark.slow
@pytest.mark.parametrize("drafter_name,block", [("smollm2-135m-instruct-b16", 8), ("smollm2-135m-instruct-dflash2-b8", 8)])
def test_real_target_mlx_is_lossless_and_tau_matches_torch(drafter_name, block):
    from flashdraft.engines.mlx import MlxEngine
    from flashdraft.engines.torch import TorchEngine
    from flashdraft.models import DRAFTERS_DIR, load_target

    target = load_target(None, dtype="float32")
    prompts = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How "
               "many clips did Natalia sell altogether in April and May?",
               "Write a short persuasive paragraph about why cities should plant more trees."]
    s = DecodeSettings(max_new_tokens=96, block_size=block, lookup=False, tree=0)
    spec = MlxEngine.open(target, DRAFTERS_DIR / drafter_name, s)
    plain = MlxEngine.open(target, plain=True)
    torch_spec = TorchEngine.open(target, str(DRAFTERS_DIR / drafter_name), s)
    taus, torch_taus = [], []
    for text in prompts:
        ids = target.encode(text)
        ref = plain.generate(ids, s.updated(block_size=1))
        ar = TorchEngine.open(target, plain=True).generate(ids, s.updated(block_size=1))
        assert_greedy_lossless(target.model, ids, ref.output_ids, ar.output_ids)  # MLX plain = torch greedy
        got = spec.generate(ids, s)
        assert got.output_ids == ref.output_ids  # MLX DFlash = MLX plain
        taus += got.acceptance_lengths
        torch_taus += torch_spec.generate(ids, s).acceptance_lengths
    tau, torch_tau = sum(taus) / len(taus), sum(torch_taus) / len(torch_taus)
    assert tau > 1.15 and abs(tau - torch_tau) <= 0.05 * torch_tau, (tau, torch_tau)  # 1.23 measured here: drafting
