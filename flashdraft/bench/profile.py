"""The machine's cost profile for speculative decoding: plain step, verify(B) and draft(B), and what they imply.

A profile is a plain dict, the same for every engine (llama.cpp measurements come in this shape too), measured in
each engine's own decoding loop on a real prompt:
    {"engine": str, "plain_ms": float, "verify_ms": {B: float}, "draft_ms": {B: float} ({} without a drafter),
     "context_len": int}
From it, per block size B: the break-even τ = (draft_ms[B] + verify_ms[B]) / plain_ms, the acceptance length a drafter
must reach to match plain decoding; with a measured τ, the predicted speedup plain_ms * τ / (draft_ms + verify_ms).
verify_ms counts the whole rest of a cycle (target pass, acceptance, rollback), so the two add up to a cycle.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .. import target as T
from ..atomic import write_text
from ..config import load_config
from ..decoding.settings import DecodeSettings
from ..engines.torch import decode_ids
from ..errors import FlashdraftError
from ..llamacpp.gguf import cached_export
from ..llamacpp.server import Completion, LlamaServer
from ..models import load_drafter_for, registered_drafter
from .datasets import Prompt, encode_turn
from .methods import DRAFTER_METHODS, LLAMACPP_METHODS
from .runs import load_records, progress
from ..engines.llamacpp import server_context
from .variants import Variant


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


def measure_loop(engine: str, decode, drafted: bool, block_sizes: list[int], context_len: int,
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
        return decode_ids(model, drafter if use else None, prompt_ids, chain_settings(b, n))

    return measure_loop("torch", decode, drafter is not None, block_sizes, len(prompt_ids) + tokens // 2, tokens,
                        repeats)


def measure_mlx(engine, block_sizes: list[int], prompt_ids: list[int], tokens: int = 128, repeats: int = 3) -> dict:
    """measure_loop on an MlxEngine, each draft evaluated before its verify so drafting is timed on its own."""
    from ..mlx.decode import decode_ids as mlx_decode_ids

    model = engine.target.model
    block_sizes = sorted(set(block_sizes))
    check_profile_args(model, block_sizes, prompt_ids, tokens, repeats)

    def decode(use: bool, b: int, n: int):
        return mlx_decode_ids(engine.mlx_target, engine.drafter if use else None, prompt_ids, chain_settings(b, n),
                              T.vocab_size(model), T.context_limit(model), split_timing=True)

    return measure_loop(f"mlx ({engine.dtype})", decode, engine.drafter is not None, block_sizes,
                        len(prompt_ids) + tokens // 2, tokens, repeats)


def measure_llamacpp(model: Path, drafter: Path | None, block_sizes: list[int], ids: list[int],
                     threads: int | None = None, tokens: int = 128, ctx: int = 4096) -> dict:
    """llama.cpp's cost profile (the shape of profile.measure_torch) measured inside its own loop on one prompt.

    plain_ms: generation time per token of plain decoding; for each B, a DFlash run at n_max = B - 1 gives
    draft_ms (llama.cpp's timer around the drafter's block pass, per cycle) and verify_ms (the rest of the generation
    time per cycle: the B-token target pass, the drafter's context update, sampling and acceptance). Runs ignore EOS
    so every one generates `tokens` tokens.
    """
    def run(server: LlamaServer) -> Completion:
        with server:
            server.complete(ids, 8, ignore_eos=True)  # warm-up: first-call allocations stay out of the timing
            return server.complete(ids, tokens, ignore_eos=True)

    plain = run(LlamaServer(model, threads=threads, ctx=ctx))
    out = {"engine": "llama.cpp", "plain_ms": plain.predicted_ms / max(1, len(plain.tokens) - 1),
           "verify_ms": {}, "draft_ms": {}, "context_len": len(ids) + tokens // 2}
    for b in block_sizes if drafter is not None else []:
        c = run(LlamaServer(model, drafter, b, threads, ctx))
        cycles = len(c.acceptance_lengths)
        if cycles and c.draft_ms is None:
            raise FlashdraftError("llama-server logged no draft timer, so its draft cost cannot be measured; "
                                  "use a llama.cpp build that logs it (make llamacpp)")
        if cycles:
            out["draft_ms"][b] = c.draft_ms / cycles
            out["verify_ms"][b] = (c.predicted_ms - c.draft_ms) / cycles
    return out


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


# ---------------------------------------------------------------- a bench run's profile

PROFILE_BLOCKS = list(range(2, 17))


def measured_taus(records: list[dict], labels: list[str], variants: dict[str, Variant]) -> dict[int, float]:
    """τ by block size from the acceptance lengths of the largest block among labels, truncated to smaller blocks."""
    runs = [lab for lab in labels if any(r["method"] == lab for r in records)]
    if not runs:
        return {}
    top = max(runs, key=lambda lab: variants[lab].settings.decode.block_size)
    b_max = variants[top].settings.decode.block_size
    hist: dict[int, int] = {}
    for r in records:
        if r["method"] == top:
            for t in r["turns"]:
                for a in t["acceptance_lengths"]:
                    hist[a] = hist.get(a, 0) + 1
    return {b: truncated_tau(hist, b) for b in PROFILE_BLOCKS if b <= b_max} if hist else {}


def run_profile(target, variants: list[Variant], datasets: dict[str, list[Prompt]], out: Path, chat: bool,
                threads: int | None, tokens: int = 128) -> dict:
    """The cost profile of each engine in the run (torch in its dtype, llama.cpp per target file, MLX) for each drafter,
    with break-even τ, and τ / best block size where this run measured the drafter; written to profile.json."""
    records = load_records(out / "samples.jsonl")
    by_label = {v.label: v for v in variants}
    drafters = list(dict.fromkeys(v.desc["drafter"] for v in variants if v.method in DRAFTER_METHODS)) or [None]
    torch_run = any(v.method not in LLAMACPP_METHODS for v in variants)
    files = list(dict.fromkeys(v.desc["gguf"] for v in variants if v.method in LLAMACPP_METHODS))
    mlx_runs = [v for v in variants if v.method == "mlx-dflash"]
    mlx_runs = list({id(v.settings.engine): v for v in mlx_runs}.values())  # one per engine (drafter, block)
    ids = encode_turn(target, next(iter(datasets.values()))[0].turns, [], None, None, chat)
    dtype = str(next(target.model.parameters()).dtype).replace("torch.", "")
    rows = []
    with progress() as bar:
        task = bar.add_task("profile", total=len(drafters) * (int(torch_run) + len(files)) + len(mlx_runs))
        for d in drafters:
            mine = [v for v in variants if v.method in DRAFTER_METHODS and v.desc["drafter"] == d]
            name = Path(d).name if d else "no drafter"
            drafter = next((v.settings.drafter for v in mine if v.settings.drafter is not None), None)
            if drafter is None and d is not None:
                drafter = load_drafter_for(target, None if d == "registered" else d)
            if torch_run:
                bar.update(task, description=f"profile · torch {dtype} · {name}")
                prof = measure_torch(target.model, drafter, PROFILE_BLOCKS, ids, tokens)
                taus = measured_taus(records, [v.label for v in mine if v.method == "dflash"]
                                     or [v.label for v in mine], by_label)
                rows.append({"label": f"torch {dtype} · {name}", "drafter": d, **prof, "tau_by_block": taus})
                bar.advance(task)
            for f in files:
                bar.update(task, description=f"profile · llama.cpp {Path(f).name} · {name}")
                drafter_gguf, blocks = None, PROFILE_BLOCKS
                if d is not None:
                    src = registered_drafter(target.name) if d == "registered" else Path(d)
                    drafter_gguf = cached_export("drafter", src, "f32", target.name)
                    blocks = [b for b in PROFILE_BLOCKS if b <= load_config(src).block_size]
                prof = measure_llamacpp(Path(f), drafter_gguf, blocks, ids, threads, tokens, server_context(target))
                same = [v.label for v in mine if v.desc.get("gguf") == f]
                taus = measured_taus(records, same or [v.label for v in mine], by_label)
                rows.append({"label": f"llama.cpp {Path(f).name} · {name}", "drafter": d, **prof,
                             "tau_by_block": taus})
                bar.advance(task)
        for v in mlx_runs:
            name = Path(v.desc["drafter"]).name
            bar.update(task, description=f"profile · mlx {dtype} · {name}")
            blocks = [b for b in PROFILE_BLOCKS if b <= v.settings.engine.drafter.config.block_size]
            prof = measure_mlx(v.settings.engine, blocks, ids, tokens)
            taus = measured_taus(records, [u.label for u in variants if u.method == "mlx-dflash"
                                           and u.desc["drafter"] == v.desc["drafter"]], by_label)
            rows.append({"label": f"mlx {dtype} · {name}", "drafter": v.desc["drafter"], **prof, "tau_by_block": taus})
            bar.advance(task)
    for r in rows:
        r["break_even"] = break_even(r)
        r["predicted"] = predict(r, r["tau_by_block"]) if r["tau_by_block"] else {}
        r["best_block"] = best_block(r, r["tau_by_block"]) if r["tau_by_block"] else None
    profile = {"blocks": PROFILE_BLOCKS, "tokens": tokens, "profiles": rows}
    write_text(out / "profile.json", json.dumps(profile, indent=2) + "\n")
    return profile
