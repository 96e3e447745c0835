"""Bench results: summary numbers, the terminal table, summary.json, report.md and PNG plots."""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import transformers

from ..atomic import write_text
from .profile import profile_table

ALL = "all"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def stats(turns: list[dict]) -> dict:
    """Pooled numbers over turns: decode throughput, τ, acceptance and stage histograms, per-cycle times, TTFT."""
    dec_tok = sum(t["new_tokens"] - t["first_tokens"] for t in turns)
    dec_s = sum(t["decode_s"] for t in turns)
    acc = [a for t in turns for a in t["acceptance_lengths"]]
    stages = [k for t in turns for k in t.get("stages", [])]  # drafter methods only (older records lack it)
    timed = [t for t in turns if t["cycle_timing"]]
    cycles = sum(len(t["acceptance_lengths"]) for t in timed)

    def per_cycle(key: str) -> float | None:
        return 1000 * sum(t[key] for t in timed) / cycles if cycles else None

    ttft = _mean([t["ttft_s"] for t in turns])
    return {"turns": len(turns), "new_tokens": sum(t["new_tokens"] for t in turns), "decode_tokens": dec_tok,
            "decode_s": dec_s, "decode_tok_s": dec_tok / dec_s if dec_s > 0 else None,
            "ttft_ms": None if ttft is None else 1000 * ttft,
            "tau": _mean(acc), "hist": {str(k): v for k, v in sorted(Counter(acc).items())}, "cycles": cycles,
            "lookup_cycles": sum(t.get("lookup_cycles", 0) for t in turns),
            "mean_stages": _mean(stages), "stages_hist": {str(k): v for k, v in sorted(Counter(stages).items())},
            "draft_ms": per_cycle("draft_s"), "verify_ms": per_cycle("verify_s"), "other_ms": per_cycle("other_s")}


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(by: dict[str, dict[tuple, dict]], m: str, base: str, keys: set) -> dict:
    """m against base on the prompts both finished: speedup, predicted speedup, token mismatches per turn."""
    common = sorted(keys & set(by.get(m, {})) & set(by.get(base, {})))
    if not common:
        return {}
    sm = stats([t for k in common for t in by[m][k]["turns"]])
    sb = stats([t for k in common for t in by[base][k]["turns"]])
    out = {"samples": len(common), "speedup": None, "predicted": None}
    if sm["decode_tok_s"] and sb["decode_tok_s"]:
        out["speedup"] = sm["decode_tok_s"] / sb["decode_tok_s"]
    if sm["cycles"] and sm["tau"] and sb["decode_tokens"]:
        t_base = sb["decode_s"] / sb["decode_tokens"]  # T_AR: mean per-token decode time of the baseline
        t_cycle = (sm["draft_ms"] + sm["verify_ms"] + sm["other_ms"]) / 1000
        out["predicted"] = t_base * sm["tau"] / t_cycle if t_cycle > 0 else None
    bad, turns = [], 0
    for k in common:
        for i, (tm, tb) in enumerate(zip(by[m][k]["turns"], by[base][k]["turns"])):
            turns += 1
            if tm["output_ids"] != tb["output_ids"]:
                bad.append({"dataset": k[0], "id": k[1], "turn": i, "token": _first_diff(tm["output_ids"], tb["output_ids"])})
    out["turns_compared"], out["mismatches"], out["examples"] = turns, len(bad), bad[:5]
    return out


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def baseline(label: str, desc: dict | None) -> str | None:
    """The plain decoding a method is measured and checked against: ar, llamacpp on the same target file, or vllm at
    the same batch size."""
    desc = desc or {}
    if "baseline" in desc:
        return desc["baseline"]
    return None if label == "ar" or desc.get("method") in ("ar", "llamacpp", "vllm", "mlx") else "ar"


def summarize(records: list[dict], labels: list[str], config: dict, datasets: dict, stopped: str | None,
              variants: dict[str, dict] | None = None, profile: dict | None = None) -> dict:
    """Everything the report shows, per dataset and pooled over all datasets (variants: label → description)."""
    by: dict[str, dict[tuple, dict]] = {}
    for r in records:
        by.setdefault(r["method"], {})[(r["dataset"], r["id"])] = r
    variants = variants or {}
    bases = {m: baseline(m, variants.get(m)) for m in labels}
    checked = [m for m in labels if bases[m] in labels] if config["temperature"] == 0 else []
    results = {}
    for scope in [*datasets, ALL]:
        keys = {(ds, p.id) for ds, ps in datasets.items() for p in ps if scope in (ALL, ds)}
        rows = {}
        for m in labels:
            mine = [by[m][k] for k in sorted(keys & set(by.get(m, {})))]
            if not mine:
                continue
            row = {"samples": len(mine), **stats([t for r in mine for t in r["turns"]]), "baseline": bases[m]}
            vs_ar, vs_hf = compare(by, m, "ar", keys), compare(by, m, "hf", keys) if "hf" in labels else {}
            vs_plain = compare(by, m, bases[m], keys) if bases[m] else {}
            row["speedup_vs_ar"] = vs_ar.get("speedup")
            row["predicted_vs_ar"] = vs_ar.get("predicted") if bases[m] == "ar" else None
            row["speedup_vs_hf"] = vs_hf.get("speedup")
            row["speedup_vs_plain"], row["predicted_vs_plain"] = vs_plain.get("speedup"), vs_plain.get("predicted")
            if m in checked and vs_plain:
                row["turns_compared"], row["mismatches"] = vs_plain["turns_compared"], vs_plain["mismatches"]
                row["mismatch_examples"] = vs_plain["examples"]
            rows[m] = row
        results[scope] = rows
    overall = results[ALL]
    mism = {m: r["mismatches"] for m, r in overall.items() if "mismatches" in r}
    planned = sum(len(ps) for ps in datasets.values()) * len(labels)
    return {"config": config, "methods": labels, "variants": variants or {},
            "datasets": {k: len(v) for k, v in datasets.items()},
            "runs_done": len(records), "runs_planned": planned, "complete": len(records) >= planned,
            "stopped": stopped, "results": results, "environment": environment(),
            "written": time.strftime("%Y-%m-%d %H:%M:%S"), "profile": profile,
            "correctness": {"checked": bool(checked), "mismatches": mism, "failed": any(v > 0 for v in mism.values()),
                            "turns_compared": {m: r["turns_compared"] for m, r in overall.items() if "turns_compared" in r}}}


# ---------------------------------------------------------------- rendering

def fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if x is None else f"{x:{spec}}{suffix}"


COLUMNS = ["method", "samples", "τ", "stages", "decode tok/s", "× ar", "× hf", "× plain", "predicted × plain",
           "TTFT ms", "draft / verify / other ms per cycle", "mismatches"]


def row_cells(m: str, r: dict) -> list[str]:
    dvo = "—" if r["draft_ms"] is None else f"{r['draft_ms']:.1f} / {r['verify_ms']:.1f} / {r['other_ms']:.1f}"
    mism = "—" if "mismatches" not in r else f"{r['mismatches']}/{r['turns_compared']}"
    plain, predicted = r.get("speedup_vs_plain"), r.get("predicted_vs_plain", r.get("predicted_vs_ar"))
    return [m, str(r["samples"]), fmt(r["tau"]), fmt(r.get("mean_stages")), fmt(r["decode_tok_s"], ".1f"),
            fmt(r["speedup_vs_ar"], ".2f", "×"), fmt(r["speedup_vs_hf"], ".2f", "×"), fmt(plain, ".2f", "×"),
            fmt(predicted, ".2f", "×"), fmt(r["ttft_ms"], ".0f"), dvo, mism]


def shown(s: dict) -> list[str]:
    """Datasets with results, then the pooled scope when there is more than one."""
    scopes = [d for d in s["datasets"] if s["results"].get(d)]
    return scopes + ([ALL] if len(scopes) > 1 else [])


def status_line(s: dict) -> str:
    done = f"{s['runs_done']} of {s['runs_planned']} (dataset, prompt, method) runs finished"
    return f"complete: {done}" if s["complete"] else f"partial ({s['stopped'] or 'not finished'}): {done}"


def correctness_line(s: dict) -> str:
    c = s["correctness"]
    if not c["checked"]:
        if s["config"]["temperature"] == 0:
            return "token-identity check skipped: no method ran beside its plain baseline (ar, or llamacpp on the " \
                   "same target file); --no-ar skips them"
        return "token-identity check skipped: temperature > 0 (sampling streams differ by method)"
    if c["failed"]:
        bad = ", ".join(f"{m} on {n}/{c['turns_compared'][m]} turns" for m, n in c["mismatches"].items() if n)
        return f"CORRECTNESS FAILURE at temperature 0: output differs from its plain baseline: {bad}"
    return "lossless: every method reproduced its plain baseline token for token at temperature 0 " \
           f"({', '.join(f'{m} {n} turns' for m, n in c['turns_compared'].items()) or 'nothing to compare'})"


def markdown(s: dict, plots: list[str]) -> str:
    """The human-readable report."""
    c, env = s["config"], s["environment"]
    lines = ["# flashdraft bench", "",
             f"Target `{c['target']}`, {c['dtype']} on {c['device']}"
             f"{' (' + env['gpu'] + ')' if 'gpu' in env else ''}; max {c['max_new_tokens']} new tokens, "
             f"temperature {c['temperature']}, top-p {c['top_p']}, top-k {c['top_k']}, seed {c['seed']}, "
             f"chat template {'on' if c['chat'] else 'off'}. "
             f"torch {env['torch']}, transformers {env['transformers']}, Python {env['python']}, "
             f"{env['cpu_count']} CPUs ({env['torch_threads']} torch threads). Written {s['written']}.", "",
             f"Status: {status_line(s)}.", "", "## Correctness", "", correctness_line(s) + ".", ""]
    for scope in shown(s):
        rows = s["results"][scope]
        lines += [f"## {'All datasets' if scope == ALL else 'Dataset `' + scope + '`'}", "",
                  "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(row_cells(m, r)) + " |" for m, r in rows.items()]
        lines.append("")
    lines += ["## Acceptance length histograms", ""]
    for scope in shown(s):
        for m, r in s["results"][scope].items():
            if m in ("ar", "hf") or not r["hist"]:
                continue
            total = sum(r["hist"].values())
            hist = ", ".join(f"{k}: {100 * v / total:.1f}%" for k, v in r["hist"].items())
            lines.append(f"- `{scope}` · {m}: τ {fmt(r['tau'])} over {total} cycles — {hist}")
            if set(r.get("stages_hist") or {}) - {"1"}:  # DLoop variants that drafted more than one stage
                n = sum(r["stages_hist"].values())
                st = ", ".join(f"{k}: {100 * v / n:.1f}%" for k, v in r["stages_hist"].items())
                lines.append(f"  - drafting stages per cycle: mean {fmt(r['mean_stages'])} — {st}")
    if s.get("profile"):
        lines += ["", "## Cost profile", "", profile_markdown(s["profile"])]
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += ["", "## Definitions", "",
              "- decode tok/s: tokens after the first one / time after the first token (prefill excluded), "
              "pooled over all turns; TTFT is reported separately.",
              "- × ar, × hf: ratio of decode tok/s to that baseline on the prompts both finished; × plain: the same "
              "against the method's plain baseline on its own engine (ar for torch methods, llamacpp on the same "
              "target file for llamacpp-dflash, vllm at the same batch size for vllm-dflash, mlx for mlx-dflash), "
              "which is also what its tokens are checked against.",
              "- llama.cpp rows use llama-server's own prompt and generation timings (no HTTP time); their draft "
              "time is llama.cpp's timer around the drafter's block pass, and the rest of each cycle (the target "
              "pass, the drafter's context update with the new target features, sampling, acceptance) shows as "
              "verify.",
              "- stages: mean drafting stages per cycle (DLoop: each stage drafts block size − 1 more tokens after "
              "the previous stage's unverified drafts; 1 = plain DFlash); — for methods without a drafter.",
              "- τ: mean tokens per target forward (acceptance length = accepted drafts + 1); for hf-lookup it is "
              "the mean size of the chunks `generate` hands its streamer.",
              "- predicted × plain = T_plain · τ / (T_d + T_v + T_o), with T_plain the baseline's mean per-token "
              "decode time and T_d, T_v, T_o the mean draft, verify and other time per cycle.",
              "- Correctness: at temperature 0 each method's tokens are compared with its plain baseline's, turn by turn; "
              "hf outputs are cut right after the first stop token, as flashdraft stops.",
              "- Multi-turn prompts replay earlier turns with the method's own previous answers (MT-Bench style)."]
    return "\n".join(lines) + "\n"


def profile_markdown(p: dict) -> str:
    """The cost-profile table and what it means."""
    rows = p["profiles"]
    table = profile_table(rows, [r["label"] for r in rows], [r.get("tau_by_block") or None for r in rows])
    notes = ["", "Per block size B: verify(B) in plain decode steps, draft(B) in ms, and the break-even τ = "
             "(draft(B) + verify(B)) / plain step, the acceptance length a drafter must reach to match plain "
             "decoding on this engine. best B: the block size with the highest predicted speedup, from this run's "
             "acceptance lengths at its largest block, truncated to smaller blocks (an approximation). Each engine is "
             f"timed inside its own decoding loop on the run's first prompt, {p.get('tokens', '?')} tokens per block "
             "size with stop tokens ignored (torch: drafter chains without prompt lookup or trees, so a cycle "
             "verifies B positions; the median of 3 interleaved rounds); verify(B) is the rest of a cycle after "
             "drafting (target pass, acceptance, rollback; on llama.cpp also the drafter's context update)."]
    for r in rows:
        if r.get("best_block") is not None:
            b = int(r["best_block"])
            tau, even, pred = ({int(k): v for k, v in r[key].items()} for key in ("tau_by_block", "break_even", "predicted"))
            notes.append(f"- {r['label']}: best B {b}: τ {tau[b]:.2f} against a break-even τ of {even[b]:.2f}, "
                         f"predicted {pred[b]:.2f}× plain")
    return table + "\n".join(notes) + "\n"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def plots(out: Path, s: dict) -> list[str]:
    """acceptance_<dataset>.png per dataset, tau.png and speedup.png; returns the file names written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        tmp = out / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        os.replace(tmp, out / name)
        written.append(name)

    scopes = [d for d in s["datasets"] if s["results"].get(d)]
    for ds in scopes:
        rows = {m: r for m, r in s["results"][ds].items() if m not in ("ar", "hf") and r["hist"]}
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(7, 3.5))
        top = max(int(k) for r in rows.values() for k in r["hist"])
        w = 0.8 / len(rows)
        for i, (m, r) in enumerate(rows.items()):
            total = sum(r["hist"].values())
            xs = list(range(1, top + 1))
            ax.bar([x + (i - (len(rows) - 1) / 2) * w for x in xs], [r["hist"].get(str(x), 0) / total for x in xs],
                   w, label=f"{m} (τ {r['tau']:.2f})")
        ax.set(xlabel="acceptance length (tokens per cycle)", ylabel="fraction of cycles",
               title=f"acceptance lengths · {ds}")
        ax.legend(fontsize=8)
        save(fig, f"acceptance_{_safe(ds)}.png")
    for key, name, ylabel, skip in [("tau", "tau.png", "τ (tokens per target forward)", ()),
                                    ("speedup_vs_ar", "speedup.png", "decode speedup vs ar", ("ar",))]:
        methods = [m for m in s["methods"] if m not in skip and any(s["results"][d].get(m, {}).get(key) for d in scopes)]
        if not methods or not scopes:
            continue
        fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(scopes) + 2), 3.5))
        w = 0.8 / len(methods)
        for i, m in enumerate(methods):
            ys = [s["results"][d].get(m, {}).get(key) or 0 for d in scopes]
            ax.bar([j + (i - (len(methods) - 1) / 2) * w for j in range(len(scopes))], ys, w, label=m)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks(range(len(scopes)), scopes)
        ax.set(ylabel=ylabel, title=f"{ylabel} per dataset")
        ax.legend(fontsize=8)
        save(fig, name)
    return written


def write_all(out: Path, s: dict) -> None:
    """summary.json, plots and report.md, each written atomically."""
    write_text(out / "summary.json", json.dumps(s, indent=2) + "\n")
    write_text(out / "report.md", markdown(s, plots(out, s)))


def print_summary(s: dict, out: Path) -> None:
    """The rich table on stdout; status and correctness on stderr."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console, err = Console(width=None if sys.stdout.isatty() else 200), Console(stderr=True)
    for scope in shown(s):
        rows = s["results"][scope]
        table = Table(title=escape(f"{'all datasets' if scope == ALL else scope}"), title_justify="left")
        for col in COLUMNS:
            table.add_column(col, justify="left" if col == "method" else "right")
        for m, r in rows.items():
            table.add_row(*map(escape, row_cells(m, r)))
        console.print(table)
    if s.get("profile"):
        console.print("cost profile", highlight=False)
        console.print(escape(profile_markdown(s["profile"])), highlight=False, soft_wrap=True)
    err.print(escape(f"flashdraft: {status_line(s)}; report in {out / 'report.md'}"), highlight=False, soft_wrap=True)
    if s["correctness"]["failed"]:
        err.print(escape(f"flashdraft: {correctness_line(s)}"), style="bold red", highlight=False, soft_wrap=True)
    else:
        print(f"flashdraft: {correctness_line(s)}", file=sys.stderr)
