"""The cost profile of a bench run: each engine's plain step, verify(B) and draft(B) measured in its own loop
(llama.cpp and MLX here, flashdraft's torch loop in flashdraft.decoding.costs, which also holds the model: the profile's
shape, break-even τ, predicted speedup and the best block size), and the report's table of them.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import target as T
from ..atomic import write_text
from ..config import load_config
from ..decoding.costs import (best_block, break_even, by_block, chain_settings, check_profile_args, measure_loop,
                              measure_torch, predict, truncated_tau)
from ..engines.llamacpp import server_context
from ..errors import FlashdraftError
from ..llamacpp.gguf import cached_export
from ..llamacpp.server import Completion, LlamaServer
from ..models import load_drafter_for, registered_drafter
from .datasets import Prompt, encode_turn
from .methods import DRAFTER_METHODS, LLAMACPP_METHODS
from .runs import load_records, progress
from .variants import Variant


def measure_mlx(engine, block_sizes: list[int], prompt_ids: list[int], tokens: int = 128, repeats: int = 3) -> dict:
    """measure_loop on an MlxEngine, each draft evaluated before its verify so drafting is timed on its own."""
    from ..mlx.decode import mlx_generate_ids

    model = engine.target.model
    block_sizes = sorted(set(block_sizes))
    check_profile_args(model, block_sizes, prompt_ids, tokens, repeats)

    def decode(use: bool, b: int, n: int):
        return mlx_generate_ids(engine.mlx_target, engine.drafter if use else None, prompt_ids, chain_settings(b, n),
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
        steps = {b: v / plain for b, v in by_block(p["verify_ms"]).items()}
        draft, even = by_block(p.get("draft_ms") or {}), break_even(p)
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
