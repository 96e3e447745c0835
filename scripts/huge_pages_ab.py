"""Packed weights in huge pages or in ordinary 4 KiB pages, side by side in one process: the default target loaded
twice (FLASHDRAFT_HUGE_PAGES=1, then 0), measured alternately: a replay of every packed linear on cold weights at
1 / 4 / 8 rows, and decoding rates (plain and speculative, 1 and 4 rows; plain 8 rows).

    python scripts/huge_pages_ab.py [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from flashdraft.api import generate, generate_batch
from flashdraft.models import load_drafter_for, load_target
from flashdraft.packed import BlockedWeight, linear

PROMPTS = Path(__file__).parents[1] / ".." / "shared" / "data" / "gsm8k_test.jsonl"


def load(huge: bool):
    os.environ["FLASHDRAFT_HUGE_PAGES"] = "1" if huge else "0"
    t = load_target(dtype="float32")
    return t, load_drafter_for(t, None)


def replay_ms(model: torch.nn.Module, rows: int) -> float:
    """Wall ms of every packed linear of model once, at `rows` rows (the weights do not fit any cache)."""
    ws = [m.packed_weight for m in model.modules() if isinstance(getattr(m, "packed_weight", None), BlockedWeight)]
    xs = {w.blocks.shape[1]: torch.randn(rows, w.blocks.shape[1]) for w in ws}
    start = time.perf_counter()
    for w in ws:
        linear(xs[w.blocks.shape[1]], w)
    return 1000 * (time.perf_counter() - start)


def rates(t, d, prompts: list[str]) -> dict[str, float]:
    """Output tok/s of plain and speculative decoding, alone and batched (fixed blocks, 96 new tokens)."""
    out = {}
    for name, fn in [("plain 1", lambda: [generate(t, None, prompts[0], max_new_tokens=96)]),
                     ("spec 1", lambda: [generate(t, d, prompts[0], max_new_tokens=96)]),
                     ("plain 4", lambda: generate_batch(t, None, prompts, max_batch=4, max_new_tokens=96)),
                     ("spec 4", lambda: generate_batch(t, d, prompts, max_batch=4, max_new_tokens=96, adaptive=False)),
                     ("plain 8", lambda: generate_batch(t, None, prompts, max_batch=8, max_new_tokens=96))]:
        start = time.perf_counter()
        results = fn()
        out[name] = sum(len(r.output_ids) for r in results) / (time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", default=str(PROMPTS))
    args = ap.parse_args()
    prompts = [json.loads(line)["turns"][0] for line in open(args.prompts)][:8]
    loaded = {"huge pages": load(True), "4 KiB pages": load(False)}
    for t, d in loaded.values():  # warm-up
        generate_batch(t, d, prompts[:4], max_batch=4, max_new_tokens=16)
    replay: dict[str, dict[int, list[float]]] = {k: {1: [], 4: [], 8: []} for k in loaded}
    decode: dict[str, list[dict[str, float]]] = {k: [] for k in loaded}
    for _ in range(args.reps):
        for name, (t, d) in loaded.items():
            for rows in replay[name]:
                replay[name][rows] += [replay_ms(t.model, rows) for _ in range(5)]
            decode[name].append(rates(t, d, prompts))
    for name in loaded:
        ms = " / ".join(f"{statistics.median(v):.1f}" for v in replay[name].values())
        tok = ", ".join(f"{k} {statistics.median(r[k] for r in decode[name]):.1f}" for k in decode[name][0])
        print(f"{name}: replay 1 / 4 / 8 rows {ms} ms | tok/s {tok}")


if __name__ == "__main__":
    main()
