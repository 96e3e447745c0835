"""The drafter's pending features joined on every cycle (as before) or kept as pieces and joined when the drafter
takes them (as now), side by side in one process, alternating: 8 `mt_bench` first turns at once, 128 new tokens,
float32, the default target and drafter; plain decoding with the drafter loaded (the server's `--block-size 1`)
and adaptive decoding.

    python scripts/pending_features_ab.py [REPS]     # default 3
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from flashdraft.api import generate_batch
from flashdraft.decoding.request import Request
from flashdraft.models import load_drafter_for, load_target

PROMPTS = Path(__file__).parents[1] / ".." / "shared" / "data" / "mt_bench.jsonl"
new_add, new_take = Request.add_pending, Request.take_pending


def old_add(self, feats):
    """Before: one tensor, joined with the new features every cycle (a block-size-1 request kept them too)."""
    p = self.pending_features
    self.pending_features = [feats if not p else torch.cat([p[0], feats], 0)]


def old_take(self):
    feats, self.pending_features = self.pending_features, []
    return feats[0]


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    t = load_target(dtype="float32")
    d = load_drafter_for(t, None)
    prompts = [json.loads(line)["turns"][0] for line in PROMPTS.read_text().splitlines()[:8]]
    res: dict[tuple[str, str], list[float]] = {}
    for rep in range(reps):
        for mode in (("old", "new") if rep % 2 == 0 else ("new", "old")):
            Request.add_pending, Request.take_pending = (old_add, old_take) if mode == "old" else (new_add, new_take)
            for name, kw in (("plain8-chat", dict(block_size=1)), ("adaptive8-chat", {})):
                start = time.perf_counter()
                out = generate_batch(t, d, prompts, max_batch=8, max_new_tokens=128, **kw)
                rate = sum(len(r.output_ids) for r in out) / (time.perf_counter() - start)
                res.setdefault((name, mode), []).append(rate)
                print(rep, mode, name, round(rate, 1), flush=True)
    for k, v in sorted(res.items()):
        print(k, [round(x, 1) for x in v], "median", round(statistics.median(v), 1))


if __name__ == "__main__":
    main()
