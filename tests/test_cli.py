"""`flashdraft generate` end to end on a tiny model directory: JSON record, streaming, one-line errors; a command
line that loads no torch for --help and argument errors."""

import json
import subprocess
import sys

import pytest

from flashdraft.checkpoint import save_drafter
from flashdraft.cli import main
from flashdraft.tree import node_depths
from helpers import hf_greedy, random_drafter, save_tiny_model_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = save_tiny_model_dir(root / "target", kind="qwen3")
    save_drafter(random_drafter(model, block_size=8), root / "drafter")
    other = save_tiny_model_dir(root / "other", kind="llama", vocab=64)
    save_drafter(random_drafter(other), root / "wrong-drafter")
    return model, root


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_record(dirs, capsys):
    model, root = dirs
    prompt = [5, 9, 11, 40, 3]
    code, out, err = run(capsys, "generate", "--target", str(root / "target"), "--drafter", str(root / "drafter"),
                         "--prompt-ids", ",".join(map(str, prompt)), "--block-size", "8", "--max-new-tokens", "48",
                         "--temperature", "0", "--dtype", "float32", "--json")
    assert code == 0, err
    rec = json.loads(out)
    assert rec["output_ids"] == hf_greedy(model, prompt, 48)
    assert rec["num_prompt_tokens"] == 5 and rec["num_new_tokens"] == 48
    assert rec["acceptance_lengths"] == [c["accepted"] + 1 for c in rec["cycles"]]
    # each block is [anchor, drafts]: the anchor is the last emitted token, kept drafts are the next outputs. A chain
    # (lookup) holds max(8, block size) drafts at most; a tree (the drafter's cycles) 7 nodes, its kept drafts a root
    # path, never deeper than the tokens still owed (prompt + 48 - anchor position)
    pos, out_ids = 0, rec["output_ids"]
    for c in rec["cycles"]:
        assert c["block"][0] == out_ids[pos]
        kept = out_ids[pos + 1: pos + 1 + c["accepted"]]
        if c["parents"] is None:
            assert c["lookup"] or len(c["block"]) == 1
            assert len(c["block"]) <= min(8, 48 - pos) and c["block"][1: c["accepted"] + 1] == kept
        else:
            assert len(c["block"]) == 1 + len(c["parents"]) <= 8
            assert max(node_depths(c["parents"])) <= min(7, 48 - pos - 1)
            node = -1
            for t in kept:
                node = next(i for i, (d, p) in enumerate(zip(c["block"][1:], c["parents"])) if d == t and p == node)
        pos += c["accepted"] + 1
    assert pos >= len(out_ids) - 1
    assert set(rec["timing"]) == {"prefill_s", "draft_s", "verify_s", "other_s", "total_s", "tokens_per_s"}
    assert rec["config"] == {"block_size": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0,
                             "loop_stages": 1, "loop_gate": -0.75, "lookup": True, "tree": 7}
    assert all(c["stages"] == (0 if c["lookup"] else 1) for c in rec["cycles"])  # lookup cycles run no drafter
    assert "τ" in err


def test_streams_text_and_compare_ar(dirs, capsys):
    model, root = dirs
    code, out, err = run(capsys, "generate", "t5 t6 t7", "--target", str(root / "target"), "--drafter",
                         str(root / "drafter"), "--max-new-tokens", "20", "--compare-ar")
    assert code == 0, err
    ids = [2, 5, 6, 7, 3, 4]  # the tiny chat template: t2 {content} t3 t4
    assert out.split() == [f"t{i}" for i in hf_greedy(model, ids, 20)]
    assert "outputs identical: yes" in err and "speedup" in err
    assert "median of 3 interleaved runs" in err  # the default: 3 timed pairs, not one noisy timing


def test_compare_ar_record_holds_every_pair(dirs, capsys):
    model, root = dirs
    base = ["generate", "--prompt-ids", "5,6,7", "--target", str(root / "target"), "--drafter", str(root / "drafter")]
    code, out, err = run(capsys, *base, "--max-new-tokens", "12", "--json", "--compare-ar", "--compare-runs", "2")
    assert code == 0, err
    cmp = json.loads(out)["compare_ar"]
    assert cmp["identical"] and cmp["ar_output_ids"] == hf_greedy(model, [5, 6, 7], 12)
    assert len(cmp["speedups"]) == 2 and all(s > 0 for s in cmp["speedups"])
    assert min(cmp["speedups"]) <= cmp["speedup"] <= max(cmp["speedups"])
    assert "median of 2 interleaved runs" in err
    code, out, err = run(capsys, *base, "--max-new-tokens", "4", "--compare-ar", "--compare-runs", "1")
    assert code == 0 and "speedup" in err and "median" not in err


def test_no_drafter_notice_and_no_chat(dirs, capsys):
    model, root = dirs
    code, out, err = run(capsys, "generate", "t5 t6", "--no-chat", "--target", str(root / "target"),
                         "--max-new-tokens", "5")
    assert code == 0 and "no drafter registered" in err and "flashdraft train" in err
    assert out.split() == [f"t{i}" for i in hf_greedy(model, [5, 6], 5)]


@pytest.mark.parametrize("extra,match", [
    (["--prompt-ids", ""], "prompt is empty"),
    (["--prompt-ids", "1,2,999"], "outside the target vocabulary"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", ",".join(["5"] * 600)], "context is 512"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--prompt-ids", "1", "--temperature", "-1"], "temperature must be >= 0"),
    (["--prompt-ids", "1", "--top-p", "0"], "top_p must be in"),
    (["--prompt-ids", "1", "--top-p", "1.5"], "top_p must be in"),
    (["--prompt-ids", "1", "--top-k", "-2"], "top_k must be >= 0"),
    (["--prompt-ids", "1", "--block-size", "0"], "block size must be >= 1"),
    (["--prompt-ids", "1", "--drafter", "DIR/nope"], "not a directory"),
    (["--prompt-ids", "1", "--drafter", "DIR/wrong-drafter"], "different target"),
    (["--prompt-ids", "1", "--drafter", "DIR/target"], "not a DFlash drafter"),
    ([], "give a prompt"),
    (["", "--no-chat"], "prompt is empty"),
    (["--prompt-ids", "1", "--compare-ar", "--compare-runs", "0"], "--compare-runs must be >= 1"),
])
def test_bad_input_exits_2_with_one_line(dirs, capsys, extra, match):
    _, root = dirs
    extra = [e.replace("DIR", str(root)) for e in extra]
    code, out, err = run(capsys, "generate", "--target", str(root / "target"), *extra)
    assert code == 2
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("flashdraft: error:") and match in lines[0], err
    assert "Traceback" not in err


def test_bad_target_exits_2(tmp_path, capsys):
    code, _, err = run(capsys, "generate", "hi", "--target", str(tmp_path / "missing"))
    assert code == 2 and "flashdraft: error:" in err and len(err.strip().splitlines()) == 1


def test_weights_only_target_dir_decodes_prompt_ids(dirs, tmp_path, capsys):
    model, root = dirs
    model.save_pretrained(tmp_path / "bare")  # no tokenizer files
    code, out, err = run(capsys, "generate", "--target", str(tmp_path / "bare"), "--drafter", str(root / "drafter"),
                         "--prompt-ids", "4,5,6", "--max-new-tokens", "16", "--json")
    assert code == 0, err
    assert json.loads(out)["output_ids"] == hf_greedy(model, [4, 5, 6], 16)
    code, _, err = run(capsys, "generate", "hello", "--target", str(tmp_path / "bare"))
    assert code == 2 and "--prompt-ids" in err


# ---------------------------------------------------------------- a light command line

LIGHT_PROBE = """
import contextlib, io, sys
from flashdraft.cli import main
codes = []
for argv in {argvs!r}:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes.append(main(argv))
        except SystemExit as e:
            codes.append(e.code)
print(codes, sorted(m for m in ("torch", "transformers", "vllm", "mlx", "fastapi") if m in sys.modules))
"""


@pytest.mark.parametrize("argvs,codes", [
    ([["--help"]], [0]),
    ([[cmd, "--help"] for cmd in ("generate", "bench", "serve", "load", "export", "trace", "prepare", "train",
                                   "draft-vocab")], [0] * 9),
    ([["generate", "hi", "--bogus"], ["generate"], ["serve", "--port", "99999"], ["serve", "--engine", "llamacpp"],
      ["serve", "--engine", "vllm", "--tree", "3"], ["bench", "--dataset", "x", "--out", "/nonexistent/x",
                                                     "--methods", "bogus"]], [2] * 6),
])
def test_help_and_argument_errors_import_no_torch(argvs, codes):
    """`flashdraft --help`, each command's --help and one-line argument errors load neither torch nor the engines
    (a fresh process: this one has torch loaded already)."""
    out = subprocess.run([sys.executable, "-c", LIGHT_PROBE.format(argvs=argvs)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"{codes} []", out.stdout
