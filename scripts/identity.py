"""Outputs that a refactor must not change, with every timing left out: generate records (greedy and seeded sampled,
across the decode options), batched outputs, bench samples and server answers, on the default target (bench reads ../shared/data/gsm8k_test.jsonl).

    python scripts/identity.py --out before.json          # on the old tree (PYTHONPATH=old-tree)
    python scripts/identity.py --out after.json
    python scripts/identity.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
           "How many clips did Natalia sell altogether in April and May?",
           "Write a haiku about the sea.",
           "Write a Python function that returns the n-th Fibonacci number."]
CASES = {  # name → DecodeSettings overrides (drafter: the registered one unless "drafter" says otherwise)
    "greedy": {}, "block8": {"block_size": 8}, "lookup": {"lookup": True}, "tree": {"tree": 6},
    "dloop": {"loop_stages": 2, "loop_gate": -1e9}, "plain": {"block_size": 1},
    "sampled": {"temperature": 0.8, "seed": 3}, "sampled-topk-topp": {"temperature": 1.0, "top_k": 50, "top_p": 0.9,
                                                                      "seed": 5},
    "sampled-lookup": {"temperature": 0.7, "seed": 11, "lookup": True},
}
TIMING = re.compile(r"(^timing$|_s$|per_s$|^speedup|time|^elapsed|^wall|^ttft|^tpot|^itl|^created$|^id$|^date)")


def strip(obj):
    """obj without timing fields (any depth)."""
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if not TIMING.search(k)}
    if isinstance(obj, list):
        return [strip(v) for v in obj]
    return obj


def generate_records(n_new: int) -> dict:
    import flashdraft
    from flashdraft.models import load_drafter_for

    target = flashdraft.load_target()
    drafter = load_drafter_for(target, None)
    dflash2 = load_drafter_for(target, Path(flashdraft.__file__).parent / "drafters/smollm2-135m-instruct-dflash2-b8")
    out = {}
    for name, kw in CASES.items():
        for i, p in enumerate(PROMPTS):
            r = flashdraft.generate(target, drafter, p, max_new_tokens=n_new, **kw)
            out[f"generate/{name}/{i}"] = strip(r.to_record())
    for name, kw in {"dflash2": {}, "dflash2-sampled": {"temperature": 0.8, "seed": 7}}.items():
        for i, p in enumerate(PROMPTS):
            out[f"generate/{name}/{i}"] = strip(flashdraft.generate(target, dflash2, p, max_new_tokens=n_new,
                                                                     **kw).to_record())
    for name, kw in {"fixed": {"adaptive": False}, "fixed-sampled": {"adaptive": False, "temperature": 0.8, "seed": 3},
                     "adaptive": {}}.items():
        rs = flashdraft.generate_batch(target, drafter, PROMPTS + PROMPTS[:1], max_new_tokens=n_new, max_batch=3, **kw)
        for i, r in enumerate(rs):
            rec = strip(r.to_record())
            if name == "adaptive":  # its widths follow measured costs: only the tokens are fixed
                rec = {"output_ids": rec["output_ids"], "text": rec["text"]}
            out[f"batch/{name}/{i}"] = rec
    return out


def bench_samples(n_new: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "flashdraft.cli", "bench", "--dataset", str(DATA / "gsm8k_test.jsonl"), "--max-samples", "2",
                        "--methods", "ar,dflash", "--max-new-tokens", str(n_new), "--out", d], check=True,
                       stdout=subprocess.DEVNULL)
        out = {}
        for f in sorted(Path(d).glob("*.jsonl")):
            for j, line in enumerate(f.read_text().splitlines()):
                out[f"bench/{f.name}/{j}"] = strip(json.loads(line))
        return out


def post(url: str, body: dict) -> dict | str:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        raw = r.read().decode()
    return raw if body.get("stream") else json.loads(raw)


def stream_text(raw: str) -> str:
    """The concatenated deltas of an SSE chat stream."""
    parts = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for c in json.loads(line[6:]).get("choices", []):
                parts.append((c.get("delta") or {}).get("content") or "")
    return "".join(parts)


def server_answers(n_new: int) -> dict:
    proc = subprocess.Popen([sys.executable, "-m", "flashdraft.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                             "--fixed-block"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        url = None
        for line in proc.stderr:
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise SystemExit("the server did not start")
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                time.sleep(0.5)
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        out = {}
        for i, p in enumerate(PROMPTS):
            msg = {"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": n_new}
            out[f"serve/chat/{i}"] = strip(post(url + "/v1/chat/completions", {**msg, "temperature": 0}))
            out[f"serve/chat-sampled/{i}"] = strip(post(url + "/v1/chat/completions",
                                                        {**msg, "temperature": 0.8, "seed": 3}))
            out[f"serve/chat-stream/{i}"] = stream_text(post(url + "/v1/chat/completions",
                                                             {**msg, "temperature": 0, "stream": True}))
            out[f"serve/completion/{i}"] = strip(post(url + "/v1/completions", {"model": model, "prompt": p,
                                                                                "max_tokens": n_new, "temperature": 0}))
        return out
    finally:
        proc.terminate()
        proc.wait(60)


def dumps(records: dict) -> str:
    """One record per line, keys sorted: small, and diffable line by line."""
    return "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(records.items())) + "\n}\n"


def unseeded(records: dict) -> dict:
    """Records with the seed a server drew for a request that sent none (greedy: it changes nothing) left out."""
    for k, r in records.items():
        if k.startswith(("serve/chat/", "serve/completion/")) and isinstance(r, dict):
            r.get("flashdraft", {}).pop("seed", None)
    return records


def compare(a: Path, b: Path) -> int:
    x, y = unseeded(json.loads(a.read_text())), unseeded(json.loads(b.read_text()))
    keys = sorted(set(x) | set(y))
    diff = [k for k in keys if x.get(k) != y.get(k)]
    for k in diff:
        print(f"differs: {k}\n  before: {json.dumps(x.get(k))[:400]}\n  after:  {json.dumps(y.get(k))[:400]}")
    print(f"{len(keys) - len(diff)} of {len(keys)} records identical")
    return 1 if diff else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", nargs=2, type=Path)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: generate, bench, serve")
    a = ap.parse_args()
    if a.compare:
        return compare(*a.compare)
    if a.out is None:
        ap.error("give --out or --compare")
    skip, out = set(a.skip.split(",")), {}
    for part, fn in (("generate", generate_records), ("bench", bench_samples), ("serve", server_answers)):
        if part not in skip:
            t = time.perf_counter()
            out |= fn(a.max_new_tokens)
            print(f"{part}: {time.perf_counter() - t:.0f} s", file=sys.stderr)
    a.out.write_text(dumps(unseeded(out)))
    print(f"{len(out)} records → {a.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
