"""`flashdraft load`: servers per mode, concurrent streaming clients, the report (tiny models, no downloads)."""

import json

import pytest
from serve_helpers import make_model_dirs

from flashdraft.bench.load import ClientOutcome, pct, summarize_clients
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


def test_rounds_interleave_the_modes_and_report_the_median(tmp_path, monkeypatch):
    """--rounds R: every load point measures each mode back to back, the first mode rotating, all servers up at once;
    the table shows each mode's median round and the range of its rounds."""
    from flashdraft.bench import load

    started, order = [], []
    monkeypatch.setattr(load, "start_server", lambda args, mode: started.append(mode) or (None, f"http://{mode}"))
    monkeypatch.setattr(load, "stop_server", lambda proc: None)
    monkeypatch.setattr(load, "served_model", lambda url: "m")
    monkeypatch.setattr(load, "run_clients", lambda *a: ([], 1.0))
    speed = {"plain": [10.0, 30.0, 20.0], "fixed": [40.0, 5.0, 50.0]}

    def measure(url, model, prompts, clients, busy, max_tokens, timeout):
        mode = url.removeprefix("http://")
        order.append(mode)
        tps = speed[mode][sum(m == mode for m in order) - 1]
        return {"busy": busy, "concurrency": clients, "requests": 2, "ok": 2, "errors": [], "output_tokens": 1,
                "wall_s": 1.0, "tokens_per_s": tps, "requests_per_s": 1.0, "latency_p50_s": 1.0,
                "latency_p95_s": 1.0, "ttft_p50_s": 0.1, "ttft_p95_s": 0.1}

    monkeypatch.setattr(load, "measure", measure)
    rows = load.run_load({"d": ["a", "b"]}, ["plain", "fixed"], [1], [0], 8, [], None, "", 2, rounds=3)
    assert started == ["plain", "fixed"]  # one server per mode for the whole run
    assert order == ["plain", "fixed", "fixed", "plain", "plain", "fixed"]  # the first mode rotates
    assert [r["round"] for r in rows] == [0, 0, 1, 1, 2, 2]
    medians = {r["mode"]: r for r in load.median_rounds(rows)}
    assert medians["plain"]["tokens_per_s"] == 20.0 and medians["plain"]["rounds_tokens_per_s"] == [10.0, 30.0, 20.0]
    assert medians["fixed"]["tokens_per_s"] == 40.0
    table = load.table(rows)
    assert "| d | 0 | 1 | fixed | 40.0 | 3: 5.0–50.0 | 2.00× |" in table


def test_policy_table_compares_adaptive_with_the_better_of_fixed_and_plain():
    """Both forms: the ratio of median rounds (drift between rounds falls into it), and the median of each round's
    own ratio (three measurements back to back)."""
    from flashdraft.bench import load

    speeds = {"plain": [10.0, 30.0, 20.0], "fixed": [20.0, 15.0, 40.0], "adaptive": [19.0, 27.0, 44.0]}
    rows = [{"dataset": "d", "busy": 0, "concurrency": 4, "round": r, "mode": m, "tokens_per_s": v[r]}
            for m, v in speeds.items() for r in range(3)]
    assert "| d | 0 | 4 | fixed | 1.350 | 0.95 0.90 1.10 | 0.950 |" in load.policy_table(rows)
    assert load.policy_table([r for r in rows if r["mode"] != "fixed"]) == ""


def test_load_refuses_bad_arguments(tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"turns": ["hi"]}) + "\n")
    base = ["load", "--dataset", str(data), "--out", str(tmp_path / "o")]
    assert main(base + ["--modes", "turbo"]) == 2
    assert main(base + ["--concurrency", "0"]) == 2
    assert main(base + ["--rounds", "0"]) == 2
    assert main(base + ["--concurrency", "4"]) == 2  # 4 clients × 2 requests need 8 prompts
    assert "need 8" in capsys.readouterr().err


def test_summary_percentiles_and_errors():
    outs = [ClientOutcome(True, 10, 1.0, 0.1), ClientOutcome(True, 10, 3.0, 0.2),
            ClientOutcome(False, error="HTTP 429")]
    s = summarize_clients(outs, 2.0)
    assert s["ok"] == 2 and s["errors"] == ["HTTP 429"] and s["tokens_per_s"] == 10.0
    assert s["latency_p50_s"] == 1.0 and s["latency_p95_s"] == 3.0 and pct([], 50) is None


def test_a_silent_server_fails_the_request_instead_of_hanging(monkeypatch):
    """A server that accepts the request and then never answers ends as a failed request, within the stall bound."""
    import socket
    import threading
    import time

    from flashdraft.bench import load

    monkeypatch.setattr(load, "STALL_S", 1.0)
    srv = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.append(srv.accept()), daemon=True).start()
    t0 = time.perf_counter()
    out = load.stream_chat(f"http://127.0.0.1:{srv.getsockname()[1]}", "m", "hi", 4, timeout=600)
    assert not out.ok and out.error in ("timeout", "TimeoutError") and time.perf_counter() - t0 < 10
    srv.close()


def test_vllm_modes_need_vllm_or_say_how(tmp_path, capsys, monkeypatch):
    import importlib.util

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"turns": [f"q{i}"]}) + "\n" for i in range(4)))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert main(["load", "--dataset", str(data), "--modes", "plain,vllm", "--concurrency", "1",
                 "--out", str(tmp_path / "o")]) == 2
    assert "make vllm" in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.slow
def test_load_runs_vllms_server_beside_flashdraft(tmp_path):
    """The peer in the same run: vLLM's own server (plain) driven by the same clients, its row compared. The default
    target: vLLM's CPU attention takes no tiny head size."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"turns": [f"hello {i}"]}) + "\n" for i in range(2)))
    out = tmp_path / "out"
    assert main(["load", "--dataset", f"p={data}", "--concurrency", "1", "--modes", "plain,vllm",
                 "--max-new-tokens", "8", "--requests-per-client", "2",
                 "--serve-args", "--dtype float32", "--out", str(out)]) == 0
    runs = {r["mode"]: r for r in json.loads((out / "load.json").read_text())["runs"]}
    assert runs["vllm"]["ok"] == runs["vllm"]["requests"] == 2 and runs["vllm"]["output_tokens"] > 0
    assert "| vllm |" in (out / "load.md").read_text() and "1.00×" in (out / "load.md").read_text()


def test_a_server_that_never_prints_cannot_hold_the_start(monkeypatch):
    """start_server gives up at its deadline even when the server writes nothing at all."""
    import time

    from flashdraft.bench import load
    from flashdraft.errors import FlashdraftError

    monkeypatch.setattr(load, "MODES", {"silent": []})
    real_popen = load.subprocess.Popen
    monkeypatch.setattr(load.subprocess, "Popen", lambda cmd, **kw: real_popen(["sleep", "30"], **kw))  # silent
    t0 = time.monotonic()
    with pytest.raises(FlashdraftError, match="did not start"):
        load.start_server([], "silent", startup_s=2)
    assert time.monotonic() - t0 < 10
