"""Where one target forward's time goes: a plain step and a block verify at batch 1 and 8, through the lean forward
with its linears on oneDNN's packed matmul, on flashdraft's matvec kernel with torch's SDPA, and on the matvec and
ragged attention kernels, in one run; optionally vLLM's plain step on the same machine.

    python scripts/profile_forward.py --out docs/bench/forward-profile [--vllm]
    python scripts/profile_forward.py --verify-attention --out docs/bench/forward-profile [--context 1000]

Each cell: the median wall time of `--reps` forwards on a ragged batch cache (rows of ~`--context` positions, as the
server holds them), and the profiler's self time by kind of op, per forward: linears, attention, cache writes,
elementwise (norms, RoPE, activations, residuals), other ops, and what is left of the wall time — Python and
dispatch. vLLM's step comes from its own engine: (time of 1 + N tokens − time of 1 token) / N per request batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flashdraft import lean as L
from flashdraft import target as T
from flashdraft.atomic import write_text
from flashdraft.models import load_target, resolve_target
from flashdraft.packed import packed_kind
from flashdraft.target_batch import BatchCache, forward_batch

KINDS = {
    "linear": ("flashdraft::matvec", "mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::bmm"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                  "aten::_softmax", "flashdraft::ragged_attention"),
    "cache write": ("aten::_index_put_impl_", "aten::index_put_"),
    "elementwise": ("aten::mul", "aten::add", "aten::pow", "aten::mean", "aten::rsqrt", "aten::silu", "aten::neg",
                    "aten::cat", "aten::div_", "aten::sum", "aten::embedding", "aten::index_select", "aten::copy_",
                    "aten::masked_fill", "aten::cos", "aten::sin", "aten::matmul", "aten::_to_copy"),
}
CELLS = ((1, 1), (1, 4), (8, 1), (8, 4))  # (rows, block width): plain step and verify of block 4, batch 1 and 8


def batch_cache(model, rows: int, context: int) -> BatchCache:
    cache = BatchCache(model, rows)
    g = torch.Generator().manual_seed(0)
    for i in range(rows):
        single = T.new_cache(model)
        T.forward(model, torch.randint(0, 40000, (context + 7 * i,), generator=g), 0, single, [])
        cache.add_row(single)
    return cache


def measure(model, rows: int, width: int, context: int, reps: int, layer_ids: list[int]) -> dict:
    """Median wall ms of one batched forward, and profiler self ms per forward by kind."""
    cache = batch_cache(model, rows, context)
    blocks = [[5 + j for j in range(width)] for _ in range(rows)]
    lens = cache.lens.clone()

    def once() -> None:
        forward_batch(model, blocks, [None] * rows, cache, layer_ids)
        cache.lens = lens.clone()  # every forward verifies on the same context

    with torch.inference_mode():
        for _ in range(5):
            once()
        walls = []
        for _ in range(reps):
            t = time.perf_counter()
            once()
            walls.append(time.perf_counter() - t)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(reps):
                once()
    self_ms = {e.key: e.self_cpu_time_total / 1e3 / reps for e in prof.key_averages()}
    kinds = {k: sum(self_ms.get(op, 0.0) for op in ops) for k, ops in KINDS.items()}
    known = {op for ops in KINDS.values() for op in ops}
    kinds["other ops"] = sum(v for op, v in self_ms.items() if op not in known and not op.startswith("ProfilerStep"))
    wall = statistics.median(walls) * 1e3
    kinds["python + dispatch"] = max(0.0, wall - sum(kinds.values()))
    return {"rows": rows, "width": width, "wall_ms": wall, "kinds": kinds}


def vllm_steps(target_dir: str, rows_list: list[int], context: int, tokens: int = 64) -> dict[int, float]:
    """vLLM's plain decode step in ms at each batch size, from its own offline engine (float32, greedy)."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=target_dir, dtype="float32", max_num_seqs=max(rows_list), enforce_eager=False)
    g = torch.Generator().manual_seed(0)
    out = {}
    for rows in rows_list:
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(0, 40000, (context + 7 * i,), generator=g).tolist())
                   for i in range(rows)]

        def run(n: int) -> float:
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - t

        run(tokens)  # warm-up
        one = statistics.median(run(1) for _ in range(3))
        full = statistics.median(run(1 + tokens) for _ in range(3))
        out[rows] = (full - one) / tokens * 1e3
    return out


def table(results: dict[str, list[dict]], vllm: dict[int, float] | None) -> str:
    kinds = list(KINDS) + ["other ops", "python + dispatch"]
    head = ["forward", "rows × width", "wall ms"] + [f"{k} ms" for k in kinds]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, cells in results.items():
        for c in cells:
            lines.append(f"| {name} | {c['rows']} × {c['width']} | {c['wall_ms']:.1f} | "
                         + " | ".join(f"{c['kinds'][k]:.1f}" for k in kinds) + " |")
    if vllm:
        for rows, ms in vllm.items():
            lines.append(f"| vLLM (its engine, plain step) | {rows} × 1 | {ms:.1f} |" + " |" * len(kinds))
    return "\n".join(lines) + "\n"


VERIFY_CELLS = ((1, 4), (1, 8), (2, 4), (2, 8), (8, 4), (8, 8), (8, 16), (1, 32))


def verify_attention(model, context: int, reps: int, layer_ids: list[int]) -> str:
    """Wall ms of verify-width forwards with attention on SDPA (plain steps only on the ragged kernel, as before
    2026-12-07) against the ragged kernel up to 64 positions, the two alternating, the best of two runs each."""
    saved = L.RAGGED_MAX_WIDTH
    lines = [f"| rows × width (context ~{context}) | SDPA ms | ragged kernel ms | SDPA / kernel |", "|---|---|---|---|"]
    for rows, width in VERIFY_CELLS:
        walls: dict[int, list[float]] = {1: [], 64: []}
        for _ in range(2):
            for most in walls:
                L.RAGGED_MAX_WIDTH = most
                walls[most].append(measure(model, rows, width, context, reps, layer_ids)["wall_ms"])
        sdpa, kernel = min(walls[1]), min(walls[64])
        lines.append(f"| {rows} × {width} | {sdpa:.1f} | {kernel:.1f} | {sdpa / kernel:.2f}× |")
        print(lines[-1], file=sys.stderr, flush=True)
    L.RAGGED_MAX_WIDTH = saved
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--vllm", action="store_true", help="also time vLLM's plain step (make vllm)")
    ap.add_argument("--verify-attention", action="store_true",
                    help="only compare verify widths' attention: SDPA against the ragged kernel")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tgt = load_target(args.target)
    model, lean = tgt.model, tgt.model.flashdraft_lean
    layer_ids = [1, T.num_layers(model) - 3]  # features as a two-layer drafter takes them
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.verify_attention:
        text = verify_attention(model, args.context, args.reps, layer_ids)
        write_text(out / f"verify-attention-{args.context}.md", text)
        print(text, end="")
        return 0
    results = {}
    before, os.environ["FLASHDRAFT_KERNEL"] = os.environ.get("FLASHDRAFT_KERNEL"), "0"
    onednn = L.lean_model(model, pack=True)  # the same lean forward with its linears packed for oneDNN instead
    if before is None:
        del os.environ["FLASHDRAFT_KERNEL"]
    else:
        os.environ["FLASHDRAFT_KERNEL"] = before
    views = [("lean forward, oneDNN linears", onednn, 0)]  # (name, lean view, RAGGED_MAX_WIDTH: 0 = SDPA)
    if packed_kind(model) == "matvec":
        views += [("lean forward, matvec kernel, SDPA", lean, 0),
                  ("lean forward, matvec + ragged attention kernels", lean, L.RAGGED_MAX_WIDTH)]
    ragged_max = L.RAGGED_MAX_WIDTH
    for name, view, width in views:
        model.flashdraft_lean, L.RAGGED_MAX_WIDTH = view, width
        results[name] = [measure(model, r, w, args.context, args.reps, layer_ids) for r, w in CELLS]
        print(table({name: results[name]}, None), file=sys.stderr, flush=True)
    model.flashdraft_lean, L.RAGGED_MAX_WIDTH = lean, ragged_max
    vllm = vllm_steps(resolve_target(tgt.name), [1, 8], args.context) if args.vllm else None
    write_text(out / "profile.json", json.dumps({"config": vars(args), "torch": results, "vllm_step_ms": vllm},
                                                indent=1) + "\n")
    write_text(out / "profile.md", table(results, vllm))
    print(table(results, vllm), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
