"""Soak `flashdraft serve`: vLLM's own benchmark client (`vllm.benchmarks.serve`, openai-chat backend) at a given
concurrency for N requests while other clients open streams and walk away mid-stream; the server's RSS is sampled
throughout. Every benchmark request must complete and a normal request must be answered after.

    python scripts/soak.py --requests 200 --concurrency 16 --disconnects 40 --out docs/bench/soak
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from flashdraft.atomic import write_text
from flashdraft.bench.load import served_model, stop_server, stream_chat, wait_healthy
from flashdraft.serve import free_port
from flashdraft.models import DEFAULT_TARGET, resolve_target


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def walk_away(url: str, model: str, n: int, done: list[int]) -> None:
    """n streams that read a couple of chunks and then close the connection."""
    u = urlparse(url)
    for i in range(n):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": f"Tell a long story {i}"}],
                           "max_tokens": 256, "temperature": 0, "stream": True})
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        for _ in range(3):
            resp.readline()
        conn.close()
        done.append(i)
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--disconnects", type=int, default=40)
    ap.add_argument("--serve-args", default="--dtype float32",
                    help="flashdraft serve's arguments; --max-queue is added, sized to admit every client (below)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = resolve_target(DEFAULT_TARGET)  # the converted target directory holds its tokenizer
    port = free_port()  # the server's log goes to out/server.log, so a failed request can be traced
    log = open(out / "server.log", "w")
    serve_args = args.serve_args.split()
    if "--max-queue" not in serve_args:  # admit all: the benchmark's clients and one walk-away at a time
        serve_args += ["--max-queue", str(args.concurrency + 1)]
    proc = subprocess.Popen([sys.executable, "-m", "flashdraft.cli", "serve", "--port", str(port), *serve_args],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    if not wait_healthy(url, proc, time.monotonic() + 600):
        proc.kill()
        raise SystemExit(f"the server did not start: see {out / 'server.log'}")
    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            samples.append((time.monotonic() - t0, rss_mib(proc.pid)))
            stop.wait(2)

    try:
        model = served_model(url)
        stream_chat(url, model, "Warm up.", 16, 120)
        threading.Thread(target=sample, daemon=True).start()
        gone: list[int] = []
        walker = threading.Thread(target=walk_away, args=(url, model, args.disconnects, gone))
        walker.start()
        cmd = [sys.executable, "-c", "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
               "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; p = P(); add_cli_args(p); "
               "main(p.parse_args(sys.argv[1:]))",
               "--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
               "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", "64",
               "--random-output-len", "64", "--num-prompts", str(args.requests), "--max-concurrency",
               str(args.concurrency), "--temperature", "0", "--save-result", "--result-dir", str(out),
               "--result-filename", "vllm_bench.json"]
        bench = subprocess.run(cmd, capture_output=True, text=True)
        walker.join()
        after = stream_chat(url, model, "What is 2 + 2?", 16, 120)
        stop.set()
        result = json.loads((out / "vllm_bench.json").read_text()) if bench.returncode == 0 else {}
        report = {"config": vars(args), "bench_returncode": bench.returncode,
                  "bench_tail": bench.stdout[-3000:] + bench.stderr[-2000:],
                  "completed": result.get("completed"), "failed": result.get("failed"),
                  "output_throughput": result.get("output_throughput"), "disconnected": len(gone),
                  "normal_request_after": after.ok, "rss_mib": samples}
        write_text(out / "soak.json", json.dumps(report, indent=1) + "\n")
        first, last = samples[0][1], samples[-1][1]
        print(f"completed {report['completed']}/{args.requests}, failed {report['failed']}, walked away "
              f"{len(gone)}, request after: {'ok' if after.ok else after.error}; RSS {first:.0f} → max "
              f"{max(r for _, r in samples):.0f} → {last:.0f} MiB")
        return 0 if bench.returncode == 0 and after.ok else 1
    finally:
        stop.set()
        stop_server(proc)
        log.close()


if __name__ == "__main__":
    sys.exit(main())
