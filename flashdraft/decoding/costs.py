"""The cost model of speculative decoding on a machine: plain step, verify(B) and draft(B), and what they imply.

A profile is a plain dict, the same for every engine (llama.cpp and MLX measurements come in this shape too, see
flashdraft/bench/profile.py), measured in each engine's own decoding loop on a real prompt:
    {"engine": str, "plain_ms": float, "verify_ms": {B: float}, "draft_ms": {B: float} ({} without a drafter),
     "context_len": int}
From it, per block size B: the break-even τ = (draft_ms[B] + verify_ms[B]) / plain_ms, the acceptance length a drafter
must reach to match plain decoding; with a measured τ, the predicted speedup plain_ms * τ / (draft_ms + verify_ms).
verify_ms counts the whole rest of a cycle (target pass, acceptance, rollback), so the two add up to a cycle.

Used by `flashdraft bench --profile` and by `flashdraft serve --engine vllm` (its block size on a CPU).
"""

from __future__ import annotations

import statistics
from typing import Callable

from .. import target as T
from ..errors import FlashdraftError
from . import generate_ids
from .settings import DecodeSettings


def check_profile_args(model, block_sizes: list[int], prompt_ids: list[int], tokens: int,
                       repeats: int = 1) -> None:
    """One-line errors for block sizes and lengths the measurement cannot take."""
    if not block_sizes or min(block_sizes) < 2:
        raise FlashdraftError(f"profile block sizes must be >= 2 (block size 1 is the plain step), got {block_sizes}")
    if tokens < 2:
        raise FlashdraftError(f"the profile must generate at least 2 tokens per run, got {tokens}")
    if repeats < 1:
        raise FlashdraftError(f"the profile needs at least 1 round of runs, got {repeats}")
    limit = T.context_limit(model)
    if not prompt_ids or len(prompt_ids) + tokens > limit:
        raise FlashdraftError(f"a prompt of {len(prompt_ids)} tokens + {tokens} generated must fit the target's "
                              f"context of {limit}; use a shorter prompt or fewer tokens")


def measure_loop(engine: str, decode: Callable, drafted: bool, block_sizes: list[int], context_len: int,
                 tokens: int, repeats: int) -> dict:
    """Per-cycle costs in ms inside an engine's own loop; decode(use_drafter, b, n) → a GenerationResult of n tokens.

    plain_ms: decode time per token at block size 1. For each B, a DFlash run gives draft_ms (the proposer's time
    per cycle) and verify_ms (the rest of a cycle: the B-token target pass, acceptance and cache rollback), so
    draft_ms + verify_ms is what one cycle costs and break-even τ needs no other term. Each is the median of
    `repeats` rounds that each run plain decoding and every B once.
    """
    def per_cycle(r) -> tuple[float, float]:
        t, n = r.timing, len(r.cycles)
        return 1e3 * t.draft_s / n, 1e3 * (t.total_s - t.prefill_s - t.draft_s) / n

    decode(drafted, max(block_sizes) if drafted else 1, 8)  # warm-up: first-call costs stay out
    plain: list[float] = []
    costs: dict[int, list[tuple[float, float]]] = {b: [] for b in block_sizes if drafted}
    for _ in range(repeats):  # rounds, not one block size after another: drift on a shared machine hits all alike
        plain.append(sum(per_cycle(decode(False, 1, tokens))))  # the whole step
        for b in costs:
            costs[b].append(per_cycle(decode(True, b, tokens)))
    return {"engine": engine, "plain_ms": statistics.median(plain),
            "verify_ms": {b: statistics.median(v for _, v in c) for b, c in costs.items()},
            "draft_ms": {b: statistics.median(d for d, _ in c) for b, c in costs.items()},
            "context_len": context_len}


def chain_settings(b: int, n: int) -> DecodeSettings:
    """Chains without lookup or stops: every cycle verifies exactly b positions (fewer only at the end)."""
    return DecodeSettings(block_size=b, max_new_tokens=n, stop_token_ids=(), lookup=False, tree=0)


def measure_torch(model, drafter, block_sizes: list[int], prompt_ids: list[int], tokens: int = 128,
                  repeats: int = 3) -> dict:
    """measure_loop in flashdraft's own torch loop (greedy, stop tokens ignored, after a warm-up)."""
    block_sizes = sorted(set(block_sizes))
    check_profile_args(model, block_sizes, prompt_ids, tokens, repeats)

    def decode(use: bool, b: int, n: int):
        return generate_ids(model, drafter if use else None, prompt_ids, chain_settings(b, n))

    return measure_loop("torch", decode, drafter is not None, block_sizes, len(prompt_ids) + tokens // 2, tokens,
                        repeats)


def by_block(d: dict) -> dict[int, float]:
    """Block-keyed values with int keys (a profile read back from JSON has string keys)."""
    return {int(b): float(v) for b, v in d.items()}


def break_even(profile: dict) -> dict[int, float]:
    """B → (draft_ms[B] + verify_ms[B]) / plain_ms for B with a draft cost; verify alone when draft_ms is empty."""
    verify, draft = by_block(profile["verify_ms"]), by_block(profile.get("draft_ms") or {})
    plain = float(profile["plain_ms"])
    if plain <= 0:
        raise FlashdraftError(f"the profile's plain step must take a positive time, got {plain} ms")
    if not draft:
        return {b: verify[b] / plain for b in sorted(verify)}
    return {b: (draft[b] + verify[b]) / plain for b in sorted(verify) if b in draft}


def truncated_tau(hist: dict[int, int], b: int) -> float:
    """Mean of min(L, b) over a histogram {acceptance length L: cycles} measured at a block size >= b.

    An approximation of τ at block size b: a drafter's proposal at position k can depend on the block size through
    the non-causal block attention, so drafts measured in a larger block are not exactly those a block of b gives.
    """
    if b < 1:
        raise FlashdraftError(f"the block size must be >= 1, got {b}")
    hist = {int(n): int(c) for n, c in hist.items()}
    if any(n < 1 or c < 0 for n, c in hist.items()):
        raise FlashdraftError(f"acceptance lengths must be >= 1 with counts >= 0, got {hist}")
    total = sum(hist.values())
    return sum(min(n, b) * c for n, c in hist.items()) / total if total else 0.0


def predict(profile: dict, tau_by_block: dict[int, float]) -> dict[int, float]:
    """B → predicted speedup over plain decoding, plain_ms * τ / (draft_ms[B] + verify_ms[B]), where both known."""
    even, tau = break_even(profile), by_block(tau_by_block)
    return {b: tau[b] / even[b] for b in sorted(even) if b in tau}


def best_block(profile: dict, tau_by_block: dict[int, float]) -> int | None:
    """The block size with the highest predicted speedup (the smaller on ties); None when none can be predicted.

    The best may still be slower than plain decoding: compare predict(...)[best] with 1.
    """
    speedup = predict(profile, tau_by_block)
    return max(speedup, key=lambda b: (speedup[b], -b)) if speedup else None
