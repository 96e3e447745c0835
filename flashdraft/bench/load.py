"""`flashdraft load`: N concurrent streaming clients against `flashdraft serve`, per decoding mode and load.

For each mode (plain batched: block size 1; fixed: every request at its block; adaptive: the default; vllm and
vllm-dflash: vLLM's own OpenAI server, plain and with the drafter, started by `flashdraft serve --engine vllm` where
`make vllm` installed it) a server is started on the same target, prompts and settings, all side by side; for each
load point (busy processes, dataset, concurrency N) every mode is driven in turn by N client threads sending chat
requests from the dataset (each client its own slice, in order), and the run reports output tokens/s, requests/s,
p50/p95 latency and time to first token. With --busy K, K processes spin on the CPU throughout (contention);
--rounds R measures every point R times and reports each mode's median round. --url drives a server that is already
running instead (one mode, labelled by --label).
"""

from __future__ import annotations

import http.client
import json
import math
import multiprocessing
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from ..atomic import write_text
from ..errors import FlashdraftError
from ..serve import free_port

MODES = {"plain": ["--block-size", "1"], "fixed": ["--fixed-block"], "adaptive": [],
         "vllm": ["--engine", "vllm", "--block-size", "1"], "vllm-dflash": ["--engine", "vllm"]}
POLICY_MODES = {"plain", "fixed", "adaptive"}  # what the policy table compares
STALL_S = 120.0  # a server that sends nothing for this long has failed the request (no client waits forever)


@dataclass
class ClientOutcome:
    """One streamed request as a client saw it."""

    ok: bool
    tokens: int = 0
    latency_s: float = 0.0
    ttft_s: float | None = None
    error: str = ""


def pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def stream_chat(url: str, model: str, prompt: str, max_tokens: int, timeout: float) -> ClientOutcome:
    """POST a streaming chat completion; time the first content chunk and the end; count completion tokens. A read
    that waits STALL_S, or a request past `timeout`, ends it as failed."""
    u = urlparse(url)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=min(timeout, STALL_S))
    watchdog = threading.Timer(timeout, conn.close)  # a server trickling bytes resets the stall timer: cap the total
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return ClientOutcome(False, error=f"HTTP {resp.status}")
        ttft, tokens = None, 0
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return ClientOutcome(False, error=chunk["error"].get("message", "error"))
            if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        if time.perf_counter() - t0 > timeout:
            return ClientOutcome(False, error="timeout")
        return ClientOutcome(True, tokens, time.perf_counter() - t0, ttft)
    except (OSError, ValueError, http.client.HTTPException) as e:
        return ClientOutcome(False, error="timeout" if time.perf_counter() - t0 > timeout else type(e).__name__)
    finally:
        watchdog.cancel()
        conn.close()


def run_clients(url: str, model: str, prompts: list[str], clients: int, max_tokens: int,
                timeout: float) -> tuple[list[ClientOutcome], float]:
    """`clients` threads, client c sending prompts c, c + clients, … one after another → (outcomes, wall seconds)."""
    outcomes: list[ClientOutcome] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for p in prompts[c::clients]:
            out = stream_chat(url, model, p, max_tokens, timeout)
            with lock:
                outcomes.append(out)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, time.perf_counter() - t0


def summarize_clients(outcomes: list[ClientOutcome], wall_s: float) -> dict:
    ok = [o for o in outcomes if o.ok]
    lat, ttft = [o.latency_s for o in ok], [o.ttft_s for o in ok if o.ttft_s is not None]
    return {"requests": len(outcomes), "ok": len(ok), "errors": sorted({o.error for o in outcomes if not o.ok}),
            "output_tokens": sum(o.tokens for o in ok), "wall_s": round(wall_s, 3),
            "tokens_per_s": round(sum(o.tokens for o in ok) / wall_s, 3) if wall_s else 0.0,
            "requests_per_s": round(len(ok) / wall_s, 4) if wall_s else 0.0,
            "latency_p50_s": pct(lat, 50), "latency_p95_s": pct(lat, 95),
            "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95)}


def spin() -> None:
    """A busy background process (contention)."""
    while True:
        pass


def busy(k: int) -> list[multiprocessing.Process]:
    procs = [multiprocessing.Process(target=spin, daemon=True) for _ in range(k)]
    for p in procs:
        p.start()
    return procs


def start_server(serve_args: list[str], mode: str, startup_s: float = 600) -> tuple[subprocess.Popen, str]:
    """`flashdraft serve …` for one mode; returns the process and its base URL once /health answers."""
    port = ["--port", str(free_port())] if mode.startswith("vllm") else ["--port", "0"]
    cmd = [sys.executable, "-m", "flashdraft.cli", "serve", *port, *serve_args, *MODES[mode]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr] + [lines.put(None)], daemon=True).start()
    end, last = time.monotonic() + startup_s, ""
    while (left := end - time.monotonic()) > 0:  # a server that prints nothing cannot hold this past the deadline
        try:
            line = lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            continue
        if line is None:
            break
        last = line.strip() or last
        if ("serving" in line or "serves" in line) and "http://" in line:
            url = "http://" + line.split("http://", 1)[1].split("/v1")[0]
            if wait_healthy(url, proc, end):
                return proc, url
            break
    proc.kill()
    raise FlashdraftError(f"the {mode} server did not start ({last or 'no output'}): {' '.join(cmd)}")


def wait_healthy(url: str, proc: subprocess.Popen, end: float) -> bool:
    """Poll GET /health until it answers 200 (vLLM announces its port long before it serves), the process exits or
    the deadline passes."""
    u = urlparse(url)
    while time.monotonic() < end and proc.poll() is None:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return True
        except (OSError, http.client.HTTPException):
            pass
        finally:
            conn.close()
        time.sleep(1)
    return False


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def served_model(url: str) -> str:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/v1/models")
    return json.loads(conn.getresponse().read())["data"][0]["id"]


def run_load(datasets: dict[str, list[str]], modes: list[str], concurrency: list[int], busy_counts: list[int],
             max_tokens: int, serve_args: list[str], url: str | None, label: str, requests_per_client: int,
             rounds: int = 1, timeout: float = 1800) -> list[dict]:
    """Every (round, load, dataset, concurrency, mode) on the same prompts → one summary row each. The modes' servers
    run side by side (an idle one holds memory, not the cores) and each load point measures every mode back to back,
    first mode rotating from one point to the next, so that a change in the machine's speed (another process, a busy
    spell) falls on every mode alike instead of on whichever ran at the time."""
    names = [label] if url else modes
    servers: dict[str, tuple[subprocess.Popen | None, str]] = {}
    try:
        for mode in names:
            servers[mode] = (None, url) if url else start_server(serve_args, mode)
        models = {mode: served_model(base) for mode, (_, base) in servers.items()}
        first = next(iter(datasets.values()))
        for mode, (_, base) in servers.items():
            run_clients(base, models[mode], first[:2], 2, 16, timeout)  # warm-up, two at once
        rows, point = [], 0
        for r in range(rounds):
            for k in busy_counts:
                for name, prompts in datasets.items():
                    for n in concurrency:
                        for mode in names[point % len(names):] + names[: point % len(names)]:
                            rows.append(measure(servers[mode][1], models[mode], prompts[: n * requests_per_client], n,
                                                k, max_tokens, timeout) | {"mode": mode, "dataset": name, "round": r})
                            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                        point += 1
    finally:
        for proc, _ in servers.values():
            if proc is not None:
                stop_server(proc)
    return rows


def median_rounds(rows: list[dict]) -> list[dict]:
    """One row per (dataset, busy, concurrency, mode): the round with the median tok/s (the lower of the middle two
    for an even count), and every round's tok/s in `rounds_tokens_per_s`."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["busy"], r["concurrency"], r["mode"]), []).append(r)
    out = []
    for g in groups.values():
        ranked = sorted(g, key=lambda r: r["tokens_per_s"])
        out.append(ranked[(len(ranked) - 1) // 2] | {"rounds_tokens_per_s": [r["tokens_per_s"] for r in g]})
    return out


def measure(url: str, model: str, prompts: list[str], clients: int, busy_count: int, max_tokens: int,
            timeout: float) -> dict:
    """One load point: `clients` concurrent clients over `prompts`, with busy_count spinning processes."""
    procs = busy(busy_count)
    try:
        outcomes, wall = run_clients(url, model, prompts, clients, max_tokens, timeout)
    finally:
        for p in procs:
            p.terminate()
    return {"busy": busy_count, "concurrency": clients, **summarize_clients(outcomes, wall)}


def table(rows: list[dict]) -> str:
    """Markdown: one line per load point and mode (the median round where there were several, with the range of its
    rounds), and each mode's throughput relative to plain batched (and to vLLM's plain server, when it ran)."""
    rows = median_rounds(rows)
    key = lambda r: (r["dataset"], r["busy"], r["concurrency"])  # noqa: E731
    plain = {key(r): r["tokens_per_s"] for r in rows if r["mode"] == "plain"}
    peer = {key(r): r["tokens_per_s"] for r in rows if r["mode"] == "vllm"}
    out = ["| dataset | busy | concurrency | mode | output tok/s | rounds (min–max) | vs plain | vs vllm | req/s | "
           "p50 latency s | p95 latency s | p50 TTFT s | p95 TTFT s | ok |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (*key(r), r["mode"])):
        base, other, each = plain.get(key(r)), peer.get(key(r)), r["rounds_tokens_per_s"]
        rel = f"{r['tokens_per_s'] / base:.2f}×" if base else ""
        vs = f"{r['tokens_per_s'] / other:.2f}×" if other else ""
        spread = f"{len(each)}: {min(each):.1f}–{max(each):.1f}" if len(each) > 1 else "1"
        f = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
        out.append(f"| {r['dataset']} | {r['busy']} | {r['concurrency']} | {r['mode']} | {r['tokens_per_s']:.1f} | "
                   f"{spread} | {rel} | {vs} | {r['requests_per_s']:.3f} | {f(r['latency_p50_s'])} | "
                   f"{f(r['latency_p95_s'])} | {f(r['ttft_p50_s'])} | {f(r['ttft_p95_s'])} | "
                   f"{r['ok']}/{r['requests']} |")
    return "\n".join(out) + "\n"


def policy_table(rows: list[dict]) -> str:
    """Markdown, where plain, fixed and adaptive all ran: at each load point, adaptive against the better of the other
    two, as the ratio of their median rounds and, free of the drift between rounds, as the median over rounds of each
    round's own ratio (its three measurements ran back to back). Empty if those modes did not all run."""
    points: dict[tuple, list[dict[str, float]]] = {}
    for r in rows:
        points.setdefault((r["dataset"], r["busy"], r["concurrency"]), []).append(r)
    out = []
    for k, point in sorted(points.items()):
        by_round: dict[int, dict[str, float]] = {}
        for r in point:
            by_round.setdefault(r["round"], {})[r["mode"]] = r["tokens_per_s"]
        rounds = [m for m in by_round.values() if POLICY_MODES <= m.keys()]
        if not rounds:
            continue
        med = {mode: statistics.median_low([m[mode] for m in rounds]) for mode in POLICY_MODES}
        better = "fixed" if med["fixed"] >= med["plain"] else "plain"
        each = [m["adaptive"] / max(m["fixed"], m["plain"], 1e-9) for m in rounds]
        out.append(f"| {k[0]} | {k[1]} | {k[2]} | {better} | {med['adaptive'] / max(med[better], 1e-9):.3f} | "
                   f"{' '.join(f'{x:.2f}' for x in each)} | {statistics.median(each):.3f} |")
    if not out:
        return ""
    return "\n".join(["| dataset | busy | concurrency | better of fixed and plain (median rounds) | adaptive / it | "
                      "each round: adaptive / better of that round | median of those |",
                      "|---|---|---|---|---|---|---|", *out]) + "\n"


def write_results(out: Path, rows: list[dict], config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "load.json", json.dumps({"config": config, "runs": rows}, indent=1) + "\n")
    policy = policy_table(rows)
    write_text(out / "load.md", table(rows) + (f"\nAdaptive against the better of fixed and plain:\n\n{policy}"
                                                 if policy else ""))
