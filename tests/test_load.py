"""`flashdraft load`: servers per mode, concurrent streaming clients, the report (tiny models, no downloads)."""

import json

import pytest
from serve_helpers import make_model_dirs

from flashdraft.bench.load import pct, summarize, Outcome
from flashdraft.cli import main


def test_load_runs_every_mode_concurrency_and_load(tmp_path, capsys):
    target, drafter = make_model_dirs(tmp_path)
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "turns": [f"hello {i}"]}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    assert main(["load", "--dataset", f"p={data}", "--concurrency", "1,2", "--modes", "plain,fixed,adaptive",
                 "--busy", "0,1", "--max-new-tokens", "12", "--serve-args", f"--target {target} --drafter {drafter}",
                 "--out", str(out)]) == 0
    runs = json.loads((out / "load.json").read_text())["runs"]
    assert {(r["mode"], r["busy"], r["concurrency"]) for r in runs} == \
        {(m, b, c) for m in ("plain", "fixed", "adaptive") for b in (0, 1) for c in (1, 2)}
    for r in runs:
        assert r["ok"] == r["requests"] == 2 * r["concurrency"] and r["errors"] == []
        assert r["output_tokens"] == 12 * r["requests"] and r["tokens_per_s"] > 0
        assert 0 < r["ttft_p50_s"] <= r["latency_p50_s"] <= r["latency_p95_s"]
    table = (out / "load.md").read_text()
    assert "| p | 1 | 2 | adaptive |" in table and "1.00×" in table


def test_load_refuses_bad_arguments(tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"turns": ["hi"]}) + "\n")
    base = ["load", "--dataset", str(data), "--out", str(tmp_path / "o")]
    assert main(base + ["--modes", "turbo"]) == 2
    assert main(base + ["--concurrency", "0"]) == 2
    assert main(base + ["--concurrency", "4"]) == 2  # 4 clients × 2 requests need 8 prompts
    assert "need 8" in capsys.readouterr().err


def test_summary_percentiles_and_errors():
    outs = [Outcome(True, 10, 1.0, 0.1), Outcome(True, 10, 3.0, 0.2), Outcome(False, error="HTTP 429")]
    s = summarize(outs, 2.0)
    assert s["ok"] == 2 and s["errors"] == ["HTTP 429"] and s["tokens_per_s"] == 10.0
    assert s["latency_p50_s"] == 1.0 and s["latency_p95_s"] == 3.0 and pct([], 50) is None
