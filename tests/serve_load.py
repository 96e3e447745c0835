"""Bounded load test for `flashdraft serve`: N concurrent clients x M streamed requests over loopback.

Every answer is checked against its reference (flashdraft.generate with the same settings, in this process); the
report gives requests/s, p50/p99 latency and time to first token, and the errors by HTTP status.

    python tests/serve_load.py                      # default target: 4 clients x 2 requests, 32 tokens, then 12 x 1
    python tests/serve_load.py --target DIR --drafter DIR --clients 3 --requests 4
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).parent))

PROMPTS = ["What is 17 * 23?", "Write a Python function that reverses a string.", "Name three colors.",
           "Explain what a hash table is in one sentence.", "Give me a synonym for happy.",
           "What is the capital of France?"]


@dataclass
class Case:
    """One request (chat with a single user message) and the text flashdraft.generate gives for it."""

    prompt: str
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    reference: str = ""


@dataclass
class Report:
    clients: int
    requests_per_client: int
    ok: int = 0
    errors: Counter = field(default_factory=Counter)  # HTTP status (or exception name) -> count
    mismatches: list = field(default_factory=list)
    latencies: list = field(default_factory=list)
    ttfts: list = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        return {"clients": self.clients, "requests_per_client": self.requests_per_client,
                "requests": self.ok + sum(self.errors.values()), "ok": self.ok,
                "errors": {str(k): v for k, v in self.errors.items()}, "mismatches": len(self.mismatches),
                "wall_s": round(self.wall_s, 3),
                "requests_per_s": round(self.ok / self.wall_s, 3) if self.wall_s else 0.0,
                "latency_p50_s": pct(self.latencies, 50), "latency_p99_s": pct(self.latencies, 99),
                "ttft_p50_s": pct(self.ttfts, 50), "ttft_p99_s": pct(self.ttfts, 99)}


def pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (with few samples p99 is the maximum)."""
    if not values:
        return None
    s = sorted(values)
    return round(s[max(0, math.ceil(p / 100 * len(s)) - 1)], 4)


def references(target, drafter, cases: list[Case]) -> None:
    """Fill each case's reference with flashdraft.generate (what `flashdraft generate` prints)."""
    import flashdraft

    for c in cases:
        c.reference = flashdraft.generate(target, drafter, c.prompt, max_new_tokens=c.max_tokens,
                                          temperature=c.temperature, seed=c.seed).text


def one_request(client: openai.OpenAI, model: str, case: Case, report: Report, lock: threading.Lock) -> None:
    t0 = time.perf_counter()
    ttft, parts = None, []
    try:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": case.prompt}],
                                                max_tokens=case.max_tokens, temperature=case.temperature,
                                                seed=case.seed, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                parts.append(chunk.choices[0].delta.content)
    except openai.APIStatusError as e:
        with lock:
            report.errors[e.status_code] += 1
        return
    except Exception as e:  # connection errors, a stream that ended in an error event, …
        with lock:
            report.errors[type(e).__name__] += 1
        return
    latency, text = time.perf_counter() - t0, "".join(parts)
    with lock:
        report.ok += 1
        report.latencies.append(latency)
        if ttft is not None:
            report.ttfts.append(ttft)
        if text != case.reference:
            report.mismatches.append({"prompt": case.prompt, "got": text, "want": case.reference})


def run_load(base_url: str, model: str, cases: list[Case], clients: int, requests_per_client: int,
             timeout: float = 300) -> Report:
    """clients threads start together; client i sends requests_per_client requests one after another."""
    report, lock = Report(clients, requests_per_client), threading.Lock()
    barrier = threading.Barrier(clients)

    def client_loop(i: int) -> None:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=timeout)
        barrier.wait(timeout)
        for j in range(requests_per_client):
            one_request(client, model, cases[(i * requests_per_client + j) % len(cases)], report, lock)

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * requests_per_client + 30)
    report.wall_s = time.perf_counter() - t0
    if any(t.is_alive() for t in threads):
        report.errors["client_thread_hung"] += 1
    return report


def main(argv: list[str] | None = None) -> int:
    import torch

    import flashdraft
    from serve_helpers import Server

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="default: the embedded default target")
    p.add_argument("--drafter", help="default: the target's registered drafter")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-queue", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=8, help="requests the server decodes together")
    p.add_argument("--burst", type=int, default=12, help="clients x 1 request for the above-the-bound run (0: skip)")
    p.add_argument("--burst-max-queue", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    target = flashdraft.load_target(args.target)
    drafter = flashdraft.load_drafter_for(target, args.drafter)
    cases = [Case(q, args.max_tokens) for q in PROMPTS[:3]] + [Case(PROMPTS[3], args.max_tokens, 0.8, 5)]
    references(target, drafter, cases)
    extra = [a for k in ("target", "drafter") if getattr(args, k) for a in (f"--{k}", getattr(args, k))]
    results = {}
    for name, clients, reqs, queue in [("below_bound", args.clients, args.requests, args.max_queue),
                                       ("above_bound", args.burst, 1, args.burst_max_queue)]:
        if clients < 1:
            continue
        server = Server(*extra, "--max-queue", str(queue), "--max-batch", str(args.max_batch))
        try:
            model = server.request("GET", "/v1/models")[1]["data"][0]["id"]
            report = run_load(server.url, model, cases, clients, reqs)
        finally:
            status = server.terminate()
        results[name] = {"max_batch": args.max_batch, "max_queue": queue, **report.summary(), "exit_status": status}
        print(json.dumps({name: results[name]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
