"""Plain decoding of the default target beside busy processes, at fixed thread counts and following the machine
(flashdraft/threads.py): tokens per second of one request and of a batch of 8, each setting in its own process, the
settings alternating so that a drift of the machine falls on all of them.

    python scripts/busy_threads.py --busy 0 2 --threads 1 2 auto --repeats 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench.jsonl"


def measure(busy: int, threads: str, tokens: int, prompts_file: str) -> dict:
    """One setting, in this process: {batch: tok/s of three runs}, the busy processes running throughout."""
    import torch

    from flashdraft.api import generate, generate_batch
    from flashdraft.bench.load import busy as spinning
    from flashdraft.models import load_target

    if threads != "auto":
        from flashdraft.threads import pin

        pin(int(threads))
    target = load_target(None, dtype="float32")
    prompts = [json.loads(line)["turns"][0] for line in open(prompts_file)][:8]
    generate(target, None, prompts[0], max_new_tokens=16)  # warm-up
    procs = spinning(busy)  # the same busy processes as `flashdraft load --busy`
    try:
        out = {}
        for batch in (1, 8):
            rates = []
            for rep in range(3):
                t0 = time.perf_counter()
                if batch == 1:
                    results = [generate(target, None, prompts[rep], max_new_tokens=tokens, stop_token_ids=[])]
                else:
                    results = generate_batch(target, None, prompts, max_new_tokens=tokens, stop_token_ids=[])
                rates.append(round(sum(len(r.output_ids) for r in results) / (time.perf_counter() - t0), 1))
            out[batch] = rates
        return {"busy": busy, "threads": threads, "tok_s": out, "threads_at_end": torch.get_num_threads()}
    finally:
        for p in procs:
            p.terminate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 2], help="spinning processes beside the decoding")
    ap.add_argument("--threads", nargs="+", default=["1", "2", "auto"], help="thread counts, or auto")
    ap.add_argument("--repeats", type=int, default=1, help="times through every setting")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--prompts", default=str(PROMPTS), help="JSONL with a 'turns' list (mt_bench)")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: BUSY THREADS, in a fresh process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(int(args.one[0]), args.one[1], args.tokens, args.prompts)))
        return
    for _ in range(args.repeats):
        for busy in args.busy:
            for threads in args.threads:
                cmd = [sys.executable, __file__, "--one", str(busy), threads, "--tokens", str(args.tokens),
                       "--prompts", args.prompts]
                print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
