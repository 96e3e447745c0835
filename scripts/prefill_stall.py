"""How long a long prompt joining the batch stalls the streams already decoding: the p99 and largest gap between text
deltas of 4 streams while a ~4k-token prompt joins, for each --prefill-chunk given (one server per value, same
prompts), in one run.

    python scripts/prefill_stall.py --chunks 8192,256 --out docs/bench/prefill-stall [--serve-args "--block-size 1"]

A chunk as large as the prompt is the behaviour before chunked prefill (the whole prompt in one pass).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from flashdraft.atomic import write_text
from flashdraft.bench.load import MODES, pct, served_model, start_server, stop_server

LONG = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(330))  # ~4,000 tokens


def stream(url: str, model: str, prompt: str, max_tokens: int, stamps: list[float]) -> None:
    """A streaming completion; appends the arrival time of every chunk that carries text."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: {") and any(c.get("text") for c in json.loads(line[6:]).get("choices", [])):
            stamps.append(time.perf_counter())
    conn.close()


def measure(url: str, delay_s: float = 3.0) -> dict:
    """4 streams of 200 tokens; after delay_s the long prompt joins → gaps of the 4 streams while it joins."""
    stamps: list[list[float]] = [[] for _ in range(4)]
    model = served_model(url)
    threads = [threading.Thread(target=stream, args=(url, model, f"Count slowly from {i} to 1000:", 200, stamps[i]))
               for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(delay_s)
    joined: list[float] = []
    t_join = time.perf_counter()
    stream(url, model, LONG, 4, joined)
    t_first = joined[0] if joined else time.perf_counter()
    for t in threads:
        t.join()
    window = [b - a for s in stamps for a, b in zip(s, s[1:]) if t_join <= b and a <= t_first]
    steady = [b - a for s in stamps for a, b in zip(s, s[1:]) if b < t_join]
    return {"join_ttft_s": t_first - t_join, "gaps_while_joining": len(window),
            "p99_gap_while_joining_s": pct(window, 99), "max_gap_while_joining_s": max(window, default=None),
            "p50_gap_before_s": pct(steady, 50)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="8192,256")
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for chunk in [int(c) for c in args.chunks.split(",")]:
        proc, url = start_server(args.serve_args.split() + ["--prefill-chunk", str(chunk)], "adaptive")
        try:
            measure(url, delay_s=1.0)  # warm-up
            rows.append({"prefill_chunk": chunk, **measure(url)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            stop_server(proc)
    lines = ["| --prefill-chunk | p99 gap while joining s | max gap while joining s | p50 gap before s | "
             "long prompt's TTFT s |", "|---|---|---|---|---|"]
    lines += [f"| {r['prefill_chunk']} | {r['p99_gap_while_joining_s']:.3f} | {r['max_gap_while_joining_s']:.3f} | "
              f"{r['p50_gap_before_s']:.3f} | {r['join_ttft_s']:.2f} |" for r in rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "stall.json", json.dumps({"config": vars(args), "runs": rows}, indent=1) + "\n")
    write_text(out / "stall.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    assert "adaptive" in MODES
    sys.exit(main())
