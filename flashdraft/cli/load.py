"""`flashdraft load`: concurrent clients against `flashdraft serve` — plain batched, fixed and adaptive speculation,
idle and under contention, on the same prompts (flashdraft/bench/load.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from ..decoding.settings import parse_list
from ..errors import FlashdraftError


def add_load(sub) -> None:
    p = sub.add_parser("load", help="load benchmark: N concurrent streaming clients against flashdraft serve",
                       description="Start `flashdraft serve` once per decoding mode (plain: block size 1; fixed: "
                                   "every request at its block; adaptive: the default) and drive it with N concurrent "
                                   "streaming clients over the datasets' first turns; report output tok/s, req/s, "
                                   "p50/p95 latency and time to first token, with K busy processes for contention.")
    p.add_argument("--dataset", action="append", required=True,
                   help="JSONL of {\"turns\": [...]} records, or NAME=PATH (repeatable)")
    p.add_argument("--concurrency", default="1,2,4,8", help="clients, comma-separated (default 1,2,4,8)")
    p.add_argument("--modes", default="plain,fixed,adaptive",
                   help="comma-separated from plain, fixed, adaptive, vllm (vLLM's server, plain) and vllm-dflash "
                        "(vLLM's server with the drafter); the vllm modes need `make vllm`")
    p.add_argument("--busy", default="0", help="busy background processes, comma-separated, e.g. 0,2 (default 0)")
    p.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends (default 2)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every load point this many times; the table shows each mode's median round and the "
                        "range (default 1; this machine's cells move ±10%% from run to run, more under --busy)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--url", help="drive this running server instead of starting one per mode (e.g. "
                                 "http://127.0.0.1:8000); --label names it")
    p.add_argument("--label", default="server", help="the mode name of --url's rows (default: server)")
    p.add_argument("--serve-args", default="",
                   help="extra arguments for each started server, one string, e.g. \"--max-batch 8 --dtype float32\"")
    p.add_argument("--out", required=True, help="results directory: load.json and load.md")
    p.set_defaults(func=cmd_load)


def cmd_load(args) -> int:
    from ..bench.datasets import load_dataset, parse_dataset
    from ..bench.load import MODES, run_load, table, write_results

    concurrency = parse_list(args.concurrency, "--concurrency", int)
    busy = parse_list(args.busy, "--busy", int)
    modes = parse_list(args.modes, "--modes", str)
    if any(m not in MODES for m in modes):
        raise FlashdraftError(f"--modes takes {', '.join(MODES)}; got {args.modes!r}")
    if any(m.startswith("vllm") for m in modes) and not args.url and importlib.util.find_spec("vllm") is None:
        raise FlashdraftError("--modes vllm/vllm-dflash need vLLM, which is not installed: run `make vllm`")
    if min(concurrency) < 1 or min(busy) < 0 or min(args.requests_per_client, args.max_new_tokens, args.rounds) < 1:
        raise FlashdraftError("--concurrency, --requests-per-client, --max-new-tokens and --rounds must be >= 1, "
                              "--busy >= 0")
    datasets = {}
    for spec in args.dataset:
        label, src = parse_dataset(spec)
        prompts = [p.turns[0] for p in load_dataset(label, src, None, 0)]
        if len(prompts) < max(concurrency) * args.requests_per_client:
            raise FlashdraftError(f"--dataset {spec}: {len(prompts)} prompts, but {max(concurrency)} clients × "
                                  f"{args.requests_per_client} requests need {max(concurrency) * args.requests_per_client}")
        datasets[label] = prompts
    rows = run_load(datasets, modes, concurrency, busy, args.max_new_tokens, args.serve_args.split(), args.url,
                    args.label, args.requests_per_client, args.rounds)
    write_results(Path(args.out), rows, {k: v for k, v in vars(args).items() if k != "func"})
    print(table(rows), end="")
    print(f"flashdraft: wrote {Path(args.out) / 'load.md'}", file=sys.stderr)
    return 0
