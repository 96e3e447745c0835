"""`flashdraft bench` end to end on tiny random models: files, losslessness, mismatch detection, resume, time limit."""

import json
import sys
import types

import pytest

from flashdraft.bench import methods, report, runs
from flashdraft.checkpoint import save_drafter
from flashdraft.cli import main
from flashdraft.errors import FlashdraftError
from helpers import VOCAB, random_drafter, tiny_target


def word_tokenizer(vocab: int = VOCAB):
    """Words w0..w{vocab-1} ↔ ids, with a tiny chat template (round-trips decoded text exactly)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.chat_template = ("{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}"
                          "{% if add_generation_prompt %}w4{% endif %}")
    return fast


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    model = tiny_target("llama")
    model.save_pretrained(root / "target")
    word_tokenizer().save_pretrained(root / "target")
    save_drafter(random_drafter(model, block_size=8), root / "drafter")
    rows = [{"id": "a", "turns": ["w10 w11 w12 w13 w10 w11 w12"]},
            {"id": "b", "turns": ["w20 w21 w22 w23 w24"]},
            {"id": "c", "turns": ["w30 w31 w32", "w40 w41"]}]
    (root / "tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def args(d, out, *extra):
    return ["bench", "--target", str(d / "target"), "--drafter", str(d / "drafter"), "--dataset",
            f"tiny={d / 'tiny.jsonl'}", "--max-new-tokens", "10", "--out", str(out), *extra]


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_all_methods_files_and_lossless(dirs, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(args(dirs, out, "--block-size", "4", "--block-size", "8")) == 0
    labels = ["ar", "hf", "hf-lookup", "dflash[drafter,b4]", "dflash[drafter,b8]"]
    recs = lines(out / "samples.jsonl")
    assert sorted((r["id"], r["method"]) for r in recs) == sorted((i, m) for i in "abc" for m in labels)
    for name in ["summary.json", "report.md", "run.json", "tau.png", "speedup.png", "acceptance_tiny.png"]:
        assert (out / name).stat().st_size > 0, name
    s = json.loads((out / "summary.json").read_text())
    assert s["complete"] and s["correctness"]["checked"] and not s["correctness"]["failed"]
    assert s["correctness"]["mismatches"] == {m: 0 for m in labels[1:]}
    row = s["results"]["all"]["dflash[drafter,b8]"]
    assert 1 <= row["tau"] <= 8 and row["predicted_vs_ar"] > 0 and row["speedup_vs_hf"] > 0
    assert sum(row["hist"].values()) == row["cycles"] > 0 and row["draft_ms"] > 0
    two = next(r for r in recs if r["id"] == "c" and r["method"] == "ar")["turns"]  # turn 2 replays turn 1's answer
    assert len(two) == 2 and two[1]["prompt_len"] > two[0]["prompt_len"] + two[0]["new_tokens"]
    assert all(len(t["output_ids"]) == 10 for r in recs for t in r["turns"])
    md = (out / "report.md").read_text()
    assert "lossless" in md and "dflash[drafter,b8]" in md and "![tau.png](tau.png)" in md
    assert "dflash[drafter,b4]" in capsys.readouterr().out


def test_broken_method_is_a_correctness_failure(dirs, tmp_path, monkeypatch, capsys):
    def broken(target, ids, s):
        r = methods.run_ar(target, ids, s)
        r.output_ids[3] = (r.output_ids[3] + 1) % VOCAB
        return r

    monkeypatch.setitem(methods.METHODS, "broken", broken)
    out = tmp_path / "run"
    assert main(args(dirs, out, "--methods", "ar,broken", "--no-chat")) == 1
    assert "CORRECTNESS FAILURE" in capsys.readouterr().err
    s = json.loads((out / "summary.json").read_text())
    assert s["correctness"]["failed"] and s["correctness"]["mismatches"] == {"broken": 4}  # 3 prompts, 4 turns
    assert s["results"]["all"]["broken"]["mismatch_examples"][0]["token"] == 3
    assert "CORRECTNESS FAILURE" in (out / "report.md").read_text()


def test_resume_skips_finished_samples(dirs, tmp_path, monkeypatch):
    out = tmp_path / "run"
    assert main(args(dirs, out, "--methods", "ar,hf", "--max-samples", "2")) == 0
    assert len(lines(out / "samples.jsonl")) == 4
    calls = []
    for name in ("ar", "hf", "dflash"):
        monkeypatch.setitem(methods.METHODS, name, lambda t, i, s, f=methods.METHODS[name], n=name: calls.append(n) or f(t, i, s))
    assert main(args(dirs, out, "--methods", "ar,hf", "--max-samples", "2")) == 0
    assert calls == [] and len(lines(out / "samples.jsonl")) == 4
    with open(out / "samples.jsonl", "a") as f:  # a torn append from a crash is dropped, not fatal
        f.write('{"dataset": "tiny", "id": "x", "meth')
    assert main(args(dirs, out, "--methods", "ar,hf,dflash")) == 0
    recs = lines(out / "samples.jsonl")
    assert len(recs) == 9 and calls.count("dflash") == 4 + 1  # 4 turns (3 prompts) + warm-up
    assert calls.count("ar") == 1 + 1 and calls.count("hf") == 1 + 1  # only the sample --max-samples 2 left out
    assert json.loads((out / "summary.json").read_text())["complete"]
    assert main(args(dirs, out, "--methods", "ar", "--max-new-tokens", "5")) == 2  # other settings: refuse


def test_limit_time_stops_cleanly(dirs, tmp_path, monkeypatch):
    ticks = iter(range(1000))
    monkeypatch.setattr(runs, "limit_clock", lambda: 0.5 * next(ticks))  # every check: +0.5 s, whatever the load
    out = tmp_path / "run"
    assert main(args(dirs, out, "--methods", "ar,hf", "--limit-time", "1.5")) == 0
    s = json.loads((out / "summary.json").read_text())
    assert not s["complete"] and "time limit" in s["stopped"] and s["runs_done"] == 2  # checks at 0.5, 1.0 pass
    assert s["runs_done"] == len(lines(out / "samples.jsonl"))
    assert "partial" in (out / "report.md").read_text()


def test_sigterm_stops_cleanly_with_a_report(dirs, tmp_path, monkeypatch):
    """A background run stopped with `kill` keeps what finished and writes its report (exit 130)."""
    import os
    import signal

    out, calls = tmp_path / "run", []
    hf = methods.METHODS["hf"]

    def hf_then_kill(t, i, s):
        calls.append(1)
        if len(calls) == 3:  # warm-up, first sample, then a kill during the second sample
            os.kill(os.getpid(), signal.SIGTERM)
        return hf(t, i, s)

    monkeypatch.setitem(methods.METHODS, "hf", hf_then_kill)
    before = signal.getsignal(signal.SIGTERM)
    assert main(args(dirs, out, "--methods", "ar,hf")) == 130
    s = json.loads((out / "summary.json").read_text())
    assert s["stopped"] == "interrupted" and not s["complete"] and s["runs_done"] == 3  # ar a, hf a, ar b
    assert s["runs_done"] == len(lines(out / "samples.jsonl")) and (out / "report.md").is_file()
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is removed again


def test_sampling_settings_skip_identity_check(dirs, tmp_path):
    out = tmp_path / "run"
    assert main(args(dirs, out, "--methods", "ar,hf", "--max-samples", "1", "--temperature", "0.8",
                     "--top-k", "20", "--top-p", "0.9")) == 0
    s = json.loads((out / "summary.json").read_text())
    assert not s["correctness"]["checked"] and s["results"]["all"]["hf"]["decode_tok_s"] > 0


def test_no_ar_runs_only_the_chosen_methods(dirs, tmp_path):
    out = tmp_path / "run"
    assert main(args(dirs, out, "--methods", "dflash", "--no-ar", "--max-samples", "2")) == 0
    s = json.loads((out / "summary.json").read_text())
    assert [r["method"] for r in lines(out / "samples.jsonl")] == [s["methods"][0]] * 2
    assert s["methods"][0].startswith("dflash") and s["results"]["all"][s["methods"][0]]["tau"] >= 1
    assert not s["correctness"]["checked"] and "--no-ar" in (out / "report.md").read_text()
    assert s["results"]["all"][s["methods"][0]]["speedup_vs_ar"] is None


def test_bad_input_is_one_line_exit_2(dirs, tmp_path, monkeypatch, capsys):
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda *a, **k: (_ for _ in ()).throw(ConnectionError("hub unreachable\nmore"))
    monkeypatch.setitem(sys.modules, "datasets", fake)
    out = str(tmp_path / "o")
    for bad in (["--dataset", "gsm8k"], ["--dataset", str(tmp_path / "missing.jsonl")], ["--methods", "ar,nope"],
                ["--block-size", "1"], ["--max-samples", "0"]):
        a = args(dirs, out, *bad)
        if bad[0] == "--dataset":
            a = a[:5] + a[7:]  # drop the default dataset
        capsys.readouterr()
        assert main(a) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("flashdraft: error:"), err
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    assert main(args(dirs, out, "--dataset", str(tmp_path / "bad.jsonl"))) == 2


def test_predicted_speedup_formula():
    def turn(n, dec, acc, d=0.0, v=0.0, o=0.0, timed=True):
        return {"new_tokens": n, "first_tokens": 1, "decode_s": dec, "ttft_s": 0.1, "acceptance_lengths": acc,
                "cycle_timing": timed, "draft_s": d, "verify_s": v, "other_s": o, "output_ids": list(range(n))}

    by = {"ar": {("d", "1"): {"turns": [turn(9, 0.8, [1] * 8, v=0.8)]}},  # T_AR = 0.1 s/token
          "dflash": {("d", "1"): {"turns": [turn(9, 0.4, [4, 4], d=0.1, v=0.2, o=0.1)]}}}  # τ 4, 0.2 s/cycle
    c = report.compare(by, "dflash", "ar", {("d", "1")})
    assert c["predicted"] == pytest.approx(0.1 * 4 / 0.2) and c["speedup"] == pytest.approx(2.0)
    assert c["mismatches"] == 0



def test_stop_token_ids_are_honoured_and_recorded(dirs, tmp_path):
    first = tmp_path / "first"
    assert main(args(dirs, first, "--methods", "ar,hf", "--max-samples", "1")) == 0
    stop = lines(first / "samples.jsonl")[0]["turns"][0]["output_ids"][2]
    out = tmp_path / "stopped"
    assert main(args(dirs, out, "--methods", "ar,hf,dflash", "--max-samples", "1", "--stop-token-ids", str(stop))) == 0
    for r in lines(out / "samples.jsonl"):  # every method stops right after the stop token, at the same place
        ids = r["turns"][0]["output_ids"]
        assert ids[-1] == stop and stop not in ids[:-1] and len(ids) <= 3, r["method"]
    s = json.loads((out / "summary.json").read_text())
    assert s["config"]["stop_token_ids"] == [stop] and not s["correctness"]["failed"]
    assert "stop_token_ids" not in json.loads((first / "summary.json").read_text())["config"]


def test_load_records_drops_only_a_torn_last_line(tmp_path, capsys):
    """A torn last line (no newline: an interrupted append) is dropped with a warning; any other bad line is an error
    that leaves the file as it was."""
    path = tmp_path / "samples.jsonl"
    good = [json.dumps({"dataset": "d", "id": str(i), "method": "ar", "turns": []}) for i in range(3)]
    path.write_text("\n".join(good) + "\n" + '{"dataset": "d", "id": "x", "meth')
    assert [r["id"] for r in runs.load_records(path)] == ["0", "1", "2"]
    assert "torn last line" in capsys.readouterr().err and path.read_text() == "\n".join(good) + "\n"
    for bad in ["\n".join([good[0], "not json", good[1]]) + "\n", "\n".join(good) + "\n{broken\n"]:
        path.write_text(bad)
        with pytest.raises(FlashdraftError, match=r"samples.jsonl:\d+: not a JSON record"):
            runs.load_records(path)
        assert path.read_text() == bad  # nothing lost
