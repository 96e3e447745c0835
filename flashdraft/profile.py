"""The machine's cost profile for speculative decoding: plain step, verify(B) and draft(B), and what they imply.

A profile is a plain dict, the same for every engine (llama.cpp measurements come in this shape too):
    {"engine": str, "plain_ms": float, "verify_ms": {B: float}, "draft_ms": {B: float} ({} without a drafter),
     "context_len": int}
From it, per block size B: the break-even τ = (draft_ms[B] + verify_ms[B]) / plain_ms, the acceptance length a drafter
must reach to match plain decoding; with a measured τ, the predicted speedup plain_ms * τ / (draft_ms + verify_ms).
Cycle overheads outside draft and verify (acceptance, cache rollback) are not counted, so predictions are upper bounds.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch
from transformers import PreTrainedModel

from . import target as T
from .decode import DecodeState, _now, drafter_proposer
from .errors import FlashdraftError
from .sampling import SamplingParams


def _median_ms(fn: Callable[[], Callable[[], None]], device: torch.device, repeats: int, warmup: int) -> float:
    """Median wall time in ms of run() over `repeats` runs after `warmup`; fn() prepares a run and returns it."""
    times = []
    for i in range(warmup + repeats):
        run = fn()
        t0 = _now(device)
        run()
        if i >= warmup:
            times.append((_now(device) - t0) * 1e3)
    return statistics.median(times)


def check_profile_args(model: PreTrainedModel, block_sizes: list[int], context_len: int, repeats: int) -> None:
    """One-line errors for block sizes and contexts the measurement cannot take."""
    if not block_sizes or min(block_sizes) < 2:
        raise FlashdraftError(f"profile block sizes must be >= 2 (block size 1 is the plain step), got {block_sizes}")
    if context_len < 1:
        raise FlashdraftError(f"the profile context must hold at least 1 token, got {context_len}")
    if repeats < 1:
        raise FlashdraftError(f"repeats must be >= 1, got {repeats}")
    limit = T.context_limit(model)
    if context_len + max(block_sizes) > limit:
        raise FlashdraftError(f"context {context_len} + block {max(block_sizes)} exceeds the target's context {limit}; "
                              "use a shorter context or smaller block sizes")


@torch.inference_mode()
def measure_torch(model: PreTrainedModel, drafter: torch.nn.Module | None, block_sizes: list[int],
                  context_len: int = 256, repeats: int = 5, warmup: int = 2, seed: int = 0) -> dict:
    """Median plain-step, verify(B) and draft(B) times in ms on top of a context of context_len random tokens.

    Every timing runs the code decode runs at the anchor position context_len: the plain step is the 1-token forward
    of block-size-1 decoding (no features), verify(B) the B-token forward with the drafter's feature layers, draft(B)
    the drafter's proposer (greedy) for B-1 drafts, including appending the previous cycle's committed features (one
    position here, the fewest a cycle commits) to its context cache, as decode counts it in Timing.draft_s.
    """
    block_sizes = sorted(set(block_sizes))
    check_profile_args(model, block_sizes, context_len, repeats)
    dev = model.device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, T.vocab_size(model), (context_len + max(block_sizes),), generator=gen).to(dev)
    layer_ids = list(drafter.config.target_layer_ids) if drafter is not None else []
    cache = T.new_cache(model)
    prefill = T.forward(model, ids[:context_len], 0, cache, layer_ids, logits_to_keep=1)

    def timed_target(n: int, feature_layers: list[int]) -> float:
        def prepare() -> Callable[[], None]:
            T.rollback_to(cache, context_len)  # drop the previous run's positions outside the timing, as decode does
            return lambda: T.forward(model, ids[context_len: context_len + n], context_len, cache, feature_layers)
        ms = _median_ms(prepare, dev, repeats, warmup)
        T.rollback_to(cache, context_len)
        return ms

    plain_ms = timed_target(1, [])  # plain decoding collects no features
    verify_ms = {b: timed_target(b, layer_ids) for b in block_sizes}
    draft_ms: dict[int, float] = {}
    if drafter is not None:
        propose = drafter_proposer(model, drafter, SamplingParams(0.0), gen=None)
        feats = prefill.features
        state = DecodeState(ids[: context_len + 1].tolist(), context_len, cache, len(ids))
        state.add_pending(feats)
        propose(state, context_len, 2)  # fills the drafter's context cache with all context_len positions

        def prepare_draft(b: int) -> Callable[[], None]:
            state.draft_cache.crop(context_len - 1)
            state.pending_features = feats[-1:]
            return lambda: propose(state, context_len, b)

        draft_ms = {b: _median_ms(lambda b=b: prepare_draft(b), dev, repeats, warmup) for b in block_sizes}
    return {"engine": "torch", "plain_ms": plain_ms, "verify_ms": verify_ms, "draft_ms": draft_ms,
            "context_len": context_len}


def _by_block(d: dict) -> dict[int, float]:
    """Block-keyed values with int keys (a profile read back from JSON has string keys)."""
    return {int(b): float(v) for b, v in d.items()}


def break_even(profile: dict) -> dict[int, float]:
    """B → (draft_ms[B] + verify_ms[B]) / plain_ms for B with a draft cost; verify alone when draft_ms is empty."""
    verify, draft = _by_block(profile["verify_ms"]), _by_block(profile.get("draft_ms") or {})
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
    even, tau = break_even(profile), _by_block(tau_by_block)
    return {b: tau[b] / even[b] for b in sorted(even) if b in tau}


def best_block(profile: dict, tau_by_block: dict[int, float]) -> int | None:
    """The block size with the highest predicted speedup (the smaller on ties); None when none can be predicted.

    The best may still be slower than plain decoding: compare predict(...)[best] with 1.
    """
    speedup = predict(profile, tau_by_block)
    return max(speedup, key=lambda b: (speedup[b], -b)) if speedup else None


def profile_table(profiles: list[dict], labels: list[str], taus: list[dict[int, float] | None] | None = None,
                  blocks: tuple[int, ...] = (2, 4, 8, 16)) -> str:
    """Markdown, one row per profile: plain ms, verify in plain steps, draft ms and break-even τ at `blocks`, best B.

    taus[i] (optional) is the measured τ by block size for profiles[i]; best B shows its predicted speedup.
    """
    taus = taus if taus is not None else [None] * len(profiles)
    if not len(profiles) == len(labels) == len(taus):
        raise FlashdraftError(f"got {len(profiles)} profiles, {len(labels)} labels and {len(taus)} τ tables; "
                              "give one label (and τ table) per profile")

    def cell(d: dict[int, float], b: int, fmt: str = "{:.2f}") -> str:
        return fmt.format(d[b]) if b in d else "–"

    head = (["profile", "engine", "ctx", "plain ms"] + [f"verify B={b} (steps)" for b in blocks]
            + [f"draft ms B={b}" for b in blocks] + [f"break-even τ B={b}" for b in blocks] + ["best B"])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p, label, tau in zip(profiles, labels, taus):
        plain = float(p["plain_ms"])
        steps = {b: v / plain for b, v in _by_block(p["verify_ms"]).items()}
        draft, even = _by_block(p.get("draft_ms") or {}), break_even(p)
        best = best_block(p, tau) if tau else None
        best_cell = f"{best} (×{predict(p, tau)[best]:.2f})" if best is not None else "–"
        row = ([label, str(p.get("engine", "?")), str(p.get("context_len", "?")), f"{plain:.2f}"]
               + [cell(steps, b) for b in blocks] + [cell(draft, b) for b in blocks]
               + [cell(even, b) for b in blocks] + [best_cell])
        rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows) + "\n"
