"""Trace pages: one self-contained HTML file that shows, cycle by cycle, where a drafter's blocks were kept or cut.

Pure: a record (`flashdraft generate --json`, or one turn of a bench sample) and a token → text function go in, one
HTML string comes out (inline CSS, JS and SVG; nothing is fetched). Every cycle is the one element with
`data-cycle="i" data-accepted="k"` in the generated text; its details (drafts, kept prefix, the first rejected draft
beside the target's token, a tree's branches) are pre-rendered and shown on hover or click.
"""

from __future__ import annotations

import html
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .atomic import write_text
from .errors import FlashdraftError
from .tree import child

TokenText = Callable[[int], str]

SOURCES = {  # where a cycle's kept path came from → the label shown
    "chain": "drafter chain", "lookup": "prompt lookup", "main": "tree, main branch", "side": "tree, side branch",
    "lookup-path": "tree, lookup path", "drafter": "drafter", "none": "no draft kept", "plain": "plain step",
}
CONTROL = {"\n": "↵", "\t": "→", "\r": "␍"}
HEAT_TOP = 5  # accepted drafts from which a cycle gets the darkest colour


@dataclass
class TraceCycle:
    """One verify cycle as the page shows it."""

    index: int
    accepted: int
    start: int  # index in output_ids of the first token it emitted
    emitted: list[int]
    block: list[int] | None  # [anchor, drafts...]; None when the record keeps acceptance lengths only
    parents: list[int] | None = None
    lookup: bool = False
    stages: int | None = None
    time_s: float | None = None
    path: tuple[int, ...] = ()  # kept draft indices (a tree: node indices root → leaf)
    lookup_nodes: frozenset[int] = frozenset()  # a tree's nodes known to come from prompt lookup
    source: str = "none"

    @property
    def drafts(self) -> list[int]:
        return self.block[1:] if self.block else []


# ---------------------------------------------------------------- record → cycles

def fail(what: str) -> FlashdraftError:
    """The one-line error for a record that cannot be traced."""
    return FlashdraftError(f"cannot trace this record: {what}; pass a `flashdraft generate --json` record "
                           "or a bench samples.jsonl line")


def num(value) -> float | None:
    """A JSON number as a float, else None."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def part(record: dict, key: str) -> dict:
    """record[key] when it is an object (config, timing), else {}."""
    return record[key] if isinstance(record.get(key), dict) else {}


def int_list(value, what: str) -> list[int]:
    """value as a list of ints, or a one-line error."""
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise fail(f"{what} must be a list of integers")
    return value


def raw_cycles(record: dict) -> list[dict]:
    """The record's cycles, or cycles rebuilt from acceptance_lengths (drafts unknown) when it has none (an engine
    that reports only acceptance, as llama.cpp and vLLM: their records' cycles are empty)."""
    if isinstance(record.get("cycles"), list) and (record["cycles"] or not record.get("acceptance_lengths")):
        return record["cycles"]
    lengths = int_list(record.get("acceptance_lengths"), "acceptance_lengths")
    if any(a < 1 for a in lengths):
        raise fail("acceptance_lengths must be >= 1")
    return [{"block": None, "accepted": a - 1} for a in lengths]


def tree_path(c: TraceCycle) -> tuple[int, ...]:
    """The kept root path of a tree cycle: node indices matching its kept tokens."""
    path, at = [], -1
    for tok in c.emitted[: c.accepted]:
        at = child(c.drafts, c.parents, at, tok)
        if at is None:
            raise fail(f"cycle {c.index}: its kept tokens are not a root path of its draft tree")
        path.append(at)
    return tuple(path)


def lookup_path(c: TraceCycle, budget: int | None) -> frozenset[int]:
    """A grafted lookup path's nodes: those past the drafter's budget were appended by the graft, the last its leaf."""
    if not (c.lookup and c.parents and budget is not None and len(c.drafts) > budget):
        return frozenset()
    nodes, at = set(), len(c.drafts) - 1
    while at >= 0:
        nodes.add(at)
        at = c.parents[at]
    return frozenset(nodes)


def source_of(c: TraceCycle) -> str:
    """Where the kept path came from (a key of SOURCES)."""
    if c.block is None:
        return "lookup" if c.lookup else ("drafter" if c.accepted else "none")
    if not c.drafts:
        return "plain"
    if not c.accepted:
        return "none"
    if c.parents is None:
        return "lookup" if c.lookup else "chain"
    if c.lookup_nodes and set(c.path) <= c.lookup_nodes:
        return "lookup-path"
    firsts = {p: i for i, p in reversed(list(enumerate(c.parents)))}  # each node's first (likeliest) child
    return "main" if all(firsts[c.parents[n]] == n for n in c.path) else "side"


def check_cycle(raw: dict, i: int) -> tuple[int, list[int] | None, list[int] | None]:
    """(accepted, block, parents) of one raw cycle, checked."""
    if not isinstance(raw, dict) or not isinstance(raw.get("accepted"), int) or raw["accepted"] < 0:
        raise fail(f"cycle {i} has no 'accepted' count >= 0")
    block = None if raw.get("block") is None else int_list(raw["block"], f"cycle {i} block")
    parents = None if raw.get("parents") is None else int_list(raw["parents"], f"cycle {i} parents")
    if block is not None and not block:
        raise fail(f"cycle {i} has an empty block (it must hold at least the anchor)")
    if block is not None and parents is None and raw["accepted"] > len(block) - 1:
        raise fail(f"cycle {i} keeps {raw['accepted']} drafts but drafted {len(block) - 1}")
    if parents is not None and (block is None or len(parents) != len(block) - 1
                                or any(not -1 <= p < j for j, p in enumerate(parents))):
        raise fail(f"cycle {i}: parents must give each draft an earlier draft or -1 (the anchor)")
    return raw["accepted"], block, parents


def build_cycles(record: dict) -> list[TraceCycle]:
    """The record's cycles with their emitted tokens, kept paths and sources; one-line errors for bad records."""
    if not isinstance(record, dict):
        raise fail("it is not a JSON object")
    out_ids = int_list(record.get("output_ids"), "output_ids")
    raws = raw_cycles(record)
    exact = raws is record.get("cycles")  # the record's own cycles, not ones rebuilt from acceptance lengths
    budget = part(record, "config").get("tree")
    cycles, pos = [], min(1, len(out_ids))
    for i, raw in enumerate(raws):
        accepted, block, parents = check_cycle(raw, i)
        emitted = out_ids[pos: pos + accepted + 1]
        if exact and (not emitted or (len(emitted) < accepted + 1 and i != len(raws) - 1)):
            raise fail(f"its cycles emit more tokens than output_ids holds ({len(out_ids)})")
        stages = raw.get("stages") if isinstance(raw.get("stages"), int) else None
        c = TraceCycle(i, accepted, pos, emitted, block, parents, bool(raw.get("lookup")), stages,
                       num(raw.get("time_s")))
        c.path = tree_path(c) if parents is not None else tuple(range(min(accepted, len(c.drafts))))
        c.lookup_nodes = lookup_path(c, budget if isinstance(budget, int) else None)
        c.source = source_of(c)
        cycles.append(c)
        pos += len(emitted)
    if exact and pos != len(out_ids):
        raise fail(f"its cycles emit {pos} tokens (with the prefill's) but output_ids holds {len(out_ids)}")
    return cycles


def mark_lookup(cycles: list[TraceCycle], stages: list, lookup_cycles: int) -> None:
    """Bench turns: a drafter cycle with 0 stages was drafted by prompt lookup (used when the counts agree)."""
    zero = [c for c, s in zip(cycles, stages) if s == 0]
    if len(stages) == len(cycles) and len(zero) == lookup_cycles:
        for c in zero:
            c.lookup, c.source = True, "lookup" if c.accepted else "none"


# ---------------------------------------------------------------- bench records

def bench_turn(record: dict, turn: int = 1) -> dict:
    """One turn (1-based) of a bench samples.jsonl record as a generate-like record (with its drafts where the bench
    recorded its cycles: drafter methods on the torch engine)."""
    turns = record.get("turns") if isinstance(record, dict) else None
    if not isinstance(turns, list) or not turns:
        raise fail("it has no 'turns' list")
    if not 1 <= turn <= len(turns):
        raise FlashdraftError(f"--turn {turn}: this sample has {len(turns)} turn(s); pick 1..{len(turns)}")
    t = turns[turn - 1]
    timing = {k: t[k] for k in ("ttft_s", "draft_s", "verify_s", "other_s", "total_s") if k in t}
    if t.get("total_s") and t.get("new_tokens"):
        timing["tokens_per_s"] = t["new_tokens"] / t["total_s"]
    return {"output_ids": t.get("output_ids"), "text": t.get("text", ""), "num_prompt_tokens": t.get("prompt_len"),
            "acceptance_lengths": t.get("acceptance_lengths"), "stages": t.get("stages") or [],
            "lookup_cycles": t.get("lookup_cycles", 0), "timing": timing,
            **({"cycles": t["cycles"]} if isinstance(t.get("cycles"), list) else {}),
            "config": {"dataset": record.get("dataset"), "id": record.get("id"), "method": record.get("method"),
                       "turn": turn}}


def record_tau(record: dict) -> float | None:
    """Mean acceptance length over all turns of a bench record (or of a generate record); None without cycles."""
    turns = record.get("turns") if isinstance(record.get("turns"), list) else [record]
    acc = [a for t in turns for a in (t.get("acceptance_lengths") or [])]
    return sum(acc) / len(acc) if acc else None


# ---------------------------------------------------------------- HTML pieces

def esc(text: str) -> str:
    """HTML-escaped text."""
    return html.escape(text, quote=True)


def visible(text: str, chip: bool = False) -> str:
    """Text as HTML with line breaks, tabs and control characters shown; in a chip, spaces too (␣)."""
    if chip and not text:
        return '<span class="ws">∅</span>'
    out = []
    for ch in text:
        if ch in CONTROL:
            out.append(f'<span class="ws">{CONTROL[ch]}</span>' + ("" if chip else ch))
        elif ch == " " and chip:
            out.append('<span class="ws">␣</span>')
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f'<span class="ws">{chr(0x2400 + ord(ch)) if ord(ch) < 32 else "␡"}</span>')
        else:
            out.append(esc(ch))
    return "".join(out)


def chip(tt: TokenText, tok: int, cls: str = "") -> str:
    """One token as a box with its id on hover."""
    return f'<span class="tok {cls}" title="id {tok}">{visible(tt(tok), chip=True)}</span>'


def chips(tt: TokenText, toks: list[int], cls: str = "") -> str:
    return "".join(chip(tt, t, cls) for t in toks)


def tau(cycles: list[TraceCycle]) -> float:
    return statistics.fmean(c.accepted + 1 for c in cycles) if cycles else 0.0


def heat(accepted: int) -> str:
    return f"a{min(accepted, HEAT_TOP)}"


def text_view(record: dict, cycles: list[TraceCycle], tt: TokenText) -> str:
    """The generated text; every cycle's emitted tokens are one span (kept drafts, then the target's token)."""
    ids = record["output_ids"]
    parts = [f'<span class="pre" title="first token: from the prefill">{visible("".join(map(tt, ids[:1])))}</span>']
    for c in cycles:
        kept, own = c.emitted[: c.accepted], c.emitted[c.accepted:]
        parts.append(f'<span class="cyc {heat(c.accepted)} s-{c.source}" data-cycle="{c.index}" '
                     f'data-accepted="{c.accepted}" tabindex="0">'
                     f'<span class="k">{visible("".join(map(tt, kept)))}</span>'
                     f'<span class="t">{visible("".join(map(tt, own)))}</span></span>')
    return f'<div class="text" id="text">{"".join(parts)}</div>'


def verdict(c: TraceCycle, tt: TokenText) -> str:
    """The cycle's outcome: the first rejected draft beside the target's token, or the bonus token, or a cut."""
    target = c.emitted[c.accepted] if len(c.emitted) > c.accepted else None
    if target is None:
        return '<p class="note">The output ended inside this cycle (stop token or length limit).</p>'
    if c.parents is not None:
        tried = [i for i, p in enumerate(c.parents) if p == (c.path[-1] if c.path else -1)]
        if not tried:
            return (f'<p class="row"><span class="lbl">bonus</span>{chip(tt, target, "tgt")} the whole branch was '
                    'kept</p>')
        return (f'<p class="row"><span class="lbl">rejected</span>{chips(tt, [c.drafts[i] for i in tried], "rej")}'
                f'<span class="arrow">target</span>{chip(tt, target, "tgt")}</p>')
    if c.block is None or c.accepted >= len(c.drafts):
        label = "target" if c.block is None else "bonus"
        return f'<p class="row"><span class="lbl">{label}</span>{chip(tt, target, "tgt")}</p>'
    return (f'<p class="row"><span class="lbl">rejected</span>{chip(tt, c.drafts[c.accepted], "rej")}'
            f'<span class="arrow">target</span>{chip(tt, target, "tgt")}</p>')


def tree_html(c: TraceCycle, tt: TokenText) -> str:
    """A draft tree as nested lists: the kept path highlighted, the failed alternatives marked."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(c.parents or []):
        kids.setdefault(p, []).append(i)
    kept, stop = set(c.path), c.path[-1] if c.path else -1

    def node(i: int) -> str:
        cls = "on" if i in kept else ("rej" if c.parents[i] == stop else "off")
        badge = '<span class="badge" title="from prompt lookup">L</span>' if i in c.lookup_nodes else ""
        sub = "".join(node(j) for j in kids.get(i, []))
        return (f'<li class="n-{cls}" data-node="{i}">{chip(tt, c.drafts[i], cls)}{badge}'
                f'{f"<ul>{sub}</ul>" if sub else ""}</li>')

    roots = "".join(node(j) for j in kids.get(-1, []))
    return (f'<ul class="tree"><li class="n-on">{chip(tt, c.block[0], "anchor")}'
            f'{f"<ul>{roots}</ul>" if roots else ""}</li></ul>')


def chain_row(c: TraceCycle, tt: TokenText) -> str:
    """A chain's drafts: kept, first rejected, and the rest (never reached)."""
    d, k = c.drafts, c.accepted
    boxes = chips(tt, d[:k], "on") + (chip(tt, d[k], "rej") if k < len(d) else "") + chips(tt, d[k + 1:], "off")
    return f'<p class="row"><span class="lbl">drafts</span>{chip(tt, c.block[0], "anchor")}{boxes}</p>'


def cycle_meta(c: TraceCycle, n_tokens: int) -> str:
    """The one-line facts of a cycle."""
    drafted = "" if c.block is None else f" of {len(c.drafts)}"
    facts = [f"kept {c.accepted}{drafted} draft{'s' if c.accepted != 1 or drafted else ''}",
             f"emitted {len(c.emitted)} (tokens {c.start + 1}–{c.start + len(c.emitted)} of {n_tokens})"]
    if c.stages and c.stages > 1:
        facts.append(f"{c.stages} drafting stages")
    if c.time_s is not None:
        facts.append(f"{1000 * c.time_s:.1f} ms")
    return " · ".join(facts)


def drafted_by(c: TraceCycle) -> str:
    """What proposed the cycle's drafts."""
    if c.lookup:
        return "drafter tree + lookup path" if c.parents else "prompt lookup"
    if c.parents:
        return "drafter tree"
    if c.block is None:
        return "drafter"
    return "drafter chain" if c.drafts else "nothing (block 1)"


def detail(c: TraceCycle, tt: TokenText, n_tokens: int) -> str:
    """The pre-rendered details of one cycle (shown on hover or click)."""
    if c.block is None:
        body = '<p class="note">This record keeps acceptance lengths only: the drafts were not recorded.</p>'
    elif c.parents is not None:
        body = tree_html(c, tt)
    else:
        body = chain_row(c, tt)
    return (f'<section class="detail" data-detail="{c.index}" hidden>'
            f'<h3>Cycle {c.index} <span class="src s-{c.source}">{SOURCES[c.source]}</span></h3>'
            f'<p class="meta">{cycle_meta(c, n_tokens)} · drafted by {drafted_by(c)}</p>{body}{verdict(c, tt)}'
            f'<p class="row"><span class="lbl">emitted</span>{chips(tt, c.emitted[: c.accepted], "on")}'
            f'{chips(tt, c.emitted[c.accepted:], "tgt")}</p></section>')


# ---------------------------------------------------------------- plots (inline SVG)

def histogram_svg(cycles: list[TraceCycle]) -> str:
    """Cycles per acceptance length (accepted + 1)."""
    counts = Counter(c.accepted + 1 for c in cycles)
    top = max(counts, default=1)
    w, h, pad = 260, 120, 18
    bw = (w - 2 * pad) / top
    peak = max(counts.values(), default=1)
    bars = []
    for a in range(1, top + 1):
        n = counts.get(a, 0)
        bh = (h - 2 * pad) * n / peak
        x, y = pad + (a - 1) * bw, h - pad - bh
        bars.append(f'<rect class="{heat(a - 1)} hb" x="{x + 1:.1f}" y="{y:.1f}" width="{bw - 2:.1f}" '
                    f'height="{bh:.1f}"><title>{n} cycles emitted {a}</title></rect>'
                    f'<text x="{x + bw / 2:.1f}" y="{h - 4}" class="ax">{a}</text>'
                    + (f'<text x="{x + bw / 2:.1f}" y="{y - 3:.1f}" class="ax">{n}</text>' if n else ""))
    return (f'<svg class="plot" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" '
            f'aria-label="acceptance histogram">{"".join(bars)}</svg>')


def cycles_svg(cycles: list[TraceCycle]) -> str:
    """One bar per cycle: its time when the record has per-cycle times, else its accepted drafts."""
    timed = bool(cycles) and all(c.time_s is not None for c in cycles)
    vals = [1000 * c.time_s if timed else c.accepted for c in cycles]
    w, h, pad = 900, 110, 22
    top = max(vals, default=0) or 1
    bw = (w - 2 * pad) / max(len(cycles), 1)
    bars = []
    for c, v in zip(cycles, vals):
        bh = max((h - 2 * pad) * v / top, 1.5)
        what = f"{v:.1f} ms" if timed else f"kept {c.accepted}"
        bars.append(f'<rect class="bar s-{c.source}" data-ref="{c.index}" x="{pad + c.index * bw:.1f}" '
                    f'y="{h - pad - bh:.1f}" width="{max(bw - 1, 0.8):.1f}" height="{bh:.1f}">'
                    f'<title>cycle {c.index}: {what} ({SOURCES[c.source]})</title></rect>')
    step = max(1, round(len(cycles) / 10 / 5) * 5) if len(cycles) > 10 else 1
    ticks = "".join(f'<text x="{pad + (i + 0.5) * bw:.1f}" y="{h - 6}" class="ax">{i}</text>'
                    for i in range(0, len(cycles), step))
    unit = "ms" if timed else "kept"
    axis = (f'<text x="{pad - 4}" y="{pad + 4}" class="ax end">{top:.4g}</text>'
            f'<text x="{pad - 4}" y="{h - pad}" class="ax end">0</text>'
            f'<text x="{w - pad}" y="{pad - 8}" class="ax end">{unit} per cycle</text>')
    return (f'<svg class="plot wide" viewBox="0 0 {w} {h}" role="img" '
            f'aria-label="per-cycle plot">{"".join(bars)}{ticks}{axis}</svg>')


def timing_svg(timing: dict) -> str:
    """The record's total time split (prefill / draft / verify / other) as one stacked bar."""
    parts = [(k, num(timing.get(f"{k}_s")) or 0.0) for k in ("prefill", "draft", "verify", "other")]
    if not parts[0][1] and num(timing.get("ttft_s")):
        parts[0] = ("prefill", num(timing["ttft_s"]))
    total = sum(v for _, v in parts)
    if total <= 0:
        return '<p class="note">No timing in this record.</p>'
    w, h, x, out = 260, 120, 0.0, []
    for k, v in parts:
        bw = w * v / total
        out.append(f'<rect class="tm-{k}" x="{x:.1f}" y="8" width="{bw:.1f}" height="22"><title>{k} {v:.3f} s'
                   f'</title></rect>')
        x += bw
    legend = "".join(f'<rect class="tm-{k}" x="0" y="{44 + 18 * i}" width="10" height="10"/>'
                     f'<text x="16" y="{53 + 18 * i}" class="lg">{k} {v:.2f} s ({100 * v / total:.0f}%)</text>'
                     for i, (k, v) in enumerate(parts))
    return (f'<svg class="plot" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" '
            f'aria-label="timing split">{"".join(out)}{legend}</svg>')


# ---------------------------------------------------------------- the page

def by_source(cycles: list[TraceCycle]) -> str:
    """Cycles and mean tokens per cycle for each kind of drafting."""
    groups: dict[str, list[TraceCycle]] = {}
    for c in cycles:
        groups.setdefault(drafted_by(c), []).append(c)
    rows = "".join(f"<tr><td>{k}</td><td>{len(v)}</td><td>{tau(v):.2f}</td></tr>" for k, v in groups.items())
    return f'<table class="src-table"><tr><th>drafted by</th><th>cycles</th><th>τ</th></tr>{rows}</table>'


def summary(record: dict, cycles: list[TraceCycle]) -> str:
    """τ, counts, settings, histogram, timing and the by-source table."""
    config, timing = part(record, "config"), part(record, "timing")
    facts = [f"{len(record['output_ids'])} new tokens", f"{len(cycles)} cycles"]
    if record.get("num_prompt_tokens") is not None:
        facts.insert(0, f"{esc(str(record['num_prompt_tokens']))} prompt tokens")
    if num(timing.get("tokens_per_s")):
        facts.append(f"{timing['tokens_per_s']:.1f} tok/s")
    settings = " · ".join(f"{esc(str(k))} {esc(str(v))}" for k, v in config.items() if v is not None)
    return (f'<section class="summary"><div class="tau"><div class="big">τ {tau(cycles):.2f}</div>'
            f'<div>{" · ".join(facts)}</div><div class="cfg">{settings}</div>{by_source(cycles)}</div>'
            f'<figure><figcaption>tokens per cycle (accepted + 1)</figcaption>{histogram_svg(cycles)}</figure>'
            f'<figure><figcaption>time, whole generation</figcaption>{timing_svg(timing)}</figure></section>')


def legend(cycles: list[TraceCycle]) -> str:
    """Colour keys for the text spans (the kept-path sources this record has)."""
    present = {c.source for c in cycles}
    heats = "".join(f'<span class="cyc a{k}">{k}{"+" if k == HEAT_TOP else ""}</span>' for k in range(HEAT_TOP + 1))
    srcs = "".join(f'<span class="key s-{k}">{SOURCES[k]}</span>'
                   for k in ("chain", "main", "side", "lookup", "lookup-path", "drafter") if k in present)
    return (f'<p class="legend">drafts kept: {heats} <span class="sep"></span> kept path (underline): {srcs}'
            f' <span class="sep"></span> <span class="cyc a2"><span class="t">dotted</span></span>: the target\'s '
            f'own token</p>')


def render(record: dict, token_text: TokenText) -> str:
    """The whole trace page for one record."""
    if isinstance(record, dict) and "turns" in record:  # a bench samples.jsonl line: its first turn
        record = bench_turn(record)
    cycles = build_cycles(record)
    if isinstance(record.get("stages"), list) and isinstance(record.get("lookup_cycles"), int):
        mark_lookup(cycles, record["stages"], record["lookup_cycles"])
    n = len(record["output_ids"])
    timed = bool(cycles) and all(c.time_s is not None for c in cycles)
    note = "" if timed else ('<p class="note">The record has no per-cycle times (timing is total only), so each bar '
                             'is the cycle\'s kept drafts. Click a bar to see the cycle.</p>')
    details = "".join(detail(c, token_text, n) for c in cycles)
    hint = ('<section class="detail" data-detail="none"><h3>Cycle details</h3><p class="note">Hover over the text or '
            'a bar to see a cycle; click to pin it; ← and → step through cycles.</p></section>')
    sample = part(record, "config").get("id")
    title = "flashdraft trace" + (f" · {esc(str(sample))}" if sample is not None else "")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{title}</title>'
            f'<style>{CSS}</style></head><body><header><h1>{title}</h1>{legend(cycles)}</header>'
            f'{summary(record, cycles)}'
            f'<section class="percycle"><h2>Per cycle</h2>{cycles_svg(cycles)}{note}</section>'
            f'<main><div class="col"><h2>Generated text</h2>{text_view(record, cycles, token_text)}</div>'
            f'<aside id="details">{hint}{details}</aside></main><script>{JS}</script></body></html>')


def write_trace(record: dict, path: str | Path, token_text: TokenText) -> Path:
    """Render record and write the page to path atomically; returns the path."""
    page = render(record, token_text)
    write_text(path, page)
    return Path(path)


CSS = """
:root{--fg:#1d2330;--mut:#667085;--line:#e4e7ec;--chain:#3563c9;--main:#12917f;--side:#8a4fc7;--lookup:#d4761c;
--lpath:#b5452b;--drafter:#3563c9}
*{box-sizing:border-box}body{margin:0 auto;max-width:1180px;padding:18px 22px;color:var(--fg);
font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;background:#fff}
h1{font-size:19px;margin:0 0 4px}h2{font-size:14px;margin:14px 0 6px;color:var(--mut);font-weight:600}
h3{font-size:14px;margin:0 0 4px}
.legend{margin:0;color:var(--mut);font-size:12px}.legend .cyc{padding:0 5px}.sep{display:inline-block;width:10px}
.key{border-bottom:3px solid;margin-right:7px;padding:0 1px}
.summary{display:flex;gap:18px;align-items:flex-start;margin-top:12px;padding:12px 0;border-top:1px solid var(--line);
border-bottom:1px solid var(--line)}
.tau{flex:1;min-width:260px}.big{font-size:30px;font-weight:700;line-height:1.1}
.cfg{color:var(--mut);font-size:12px;margin:4px 0 8px}
figure{margin:0}figcaption{font-size:12px;color:var(--mut);margin-bottom:2px}
.src-table{border-collapse:collapse;font-size:12px}.src-table td,.src-table th{padding:1px 10px 1px 0;text-align:left}
.src-table th{color:var(--mut);font-weight:600}
.plot .ax{font-size:10px;fill:var(--mut);text-anchor:middle}.plot .end{text-anchor:end}.plot .lg{font-size:11px;
fill:var(--fg)}
.plot.wide{width:100%;height:auto;display:block}
.bar{cursor:pointer}.bar:hover,.bar.sel{opacity:.55}
.tm-prefill{fill:#98a2b3}.tm-draft{fill:#f4a259}.tm-verify{fill:#3563c9}.tm-other{fill:#d0d5dd}
main{display:grid;grid-template-columns:minmax(0,1fr) 380px;gap:20px;align-items:start}
.text{white-space:pre-wrap;word-wrap:break-word;font:14px/1.9 ui-monospace,"DejaVu Sans Mono",Menlo,monospace}
.cyc{border-bottom:3px solid transparent;border-radius:2px;cursor:pointer;padding:1px 0}
.cyc+.cyc{box-shadow:inset 1px 0 #fff}.cyc .t{text-decoration:underline dotted #0006;text-underline-offset:3px}
.cyc:hover,.cyc.sel{outline:2px solid var(--fg);outline-offset:0}
.pre{color:var(--mut)}
.a0{background:#fbd9d7;fill:#f1a29c}.a1{background:#fde5c8;fill:#f7bf7d}.a2{background:#fbf1bd;fill:#e9d46a}
.a3{background:#e3f2c9;fill:#b3d97a}.a4{background:#cdeccf;fill:#79c383}.a5{background:#b4e2c8;fill:#3fa86b}
.s-chain{border-bottom-color:var(--chain);fill:var(--chain)}.s-main{border-bottom-color:var(--main);fill:var(--main)}
.s-side{border-bottom-color:var(--side);fill:var(--side)}.s-lookup{border-bottom-color:var(--lookup);fill:var(--lookup)}
.s-lookup-path{border-bottom-color:var(--lpath);fill:var(--lpath)}.s-drafter{border-bottom-color:var(--drafter);
fill:var(--drafter)}.s-none,.s-plain{fill:#c3c8d1}
.ws{color:#98a2b3}
aside{position:sticky;top:10px;border:1px solid var(--line);border-radius:8px;padding:12px 14px;background:#fafbfc;
min-height:140px;max-height:calc(100vh - 20px);overflow:auto}
aside.pinned{border-color:#667085;box-shadow:0 1px 4px #0002}
.detail .meta{color:var(--mut);font-size:12px;margin:0 0 8px}
.src{font-size:11px;font-weight:600;border-bottom:3px solid;margin-left:6px}
.row{margin:6px 0;display:flex;flex-wrap:wrap;gap:3px;align-items:center}
.lbl{width:64px;color:var(--mut);font-size:12px}.arrow{color:var(--mut);font-size:12px;margin:0 4px 0 8px}
.tok{display:inline-block;font:12.5px/1.5 ui-monospace,"DejaVu Sans Mono",Menlo,monospace;padding:0 5px;
border:1px solid #d0d5dd;border-radius:4px;background:#fff;white-space:pre}
.tok.on{background:#d1f0dc;border-color:#6cc08b}.tok.rej{background:#fde0de;border-color:#e5786f;
text-decoration:line-through}.tok.tgt{background:#dbe6fb;border-color:#6f93e0;font-weight:600}
.tok.off{color:#98a2b3}.tok.anchor{background:#eef0f3}
.tree,.tree ul{list-style:none;margin:0;padding-left:16px}.tree{padding-left:0;margin:6px 0}
.tree li{position:relative;margin:2px 0}.tree ul li::before{content:"";position:absolute;left:-11px;top:11px;
width:8px;border-top:1px solid #c3c8d1}
.badge{font-size:10px;color:#fff;background:var(--lookup);border-radius:3px;padding:0 3px;margin-left:3px}
.note{color:var(--mut);font-size:12px;margin:6px 0}
"""

JS = """
(function () {
  var shown = null, pinned = null, n = document.querySelectorAll("[data-cycle]").length;
  function q(s) { return document.querySelector(s); }
  function mark(i, on) {
    var a = q('[data-cycle="' + i + '"]'), b = q('[data-ref="' + i + '"]');
    if (a) a.classList.toggle("sel", on);
    if (b) b.classList.toggle("sel", on);
  }
  function show(i) {
    var key = i === null ? "none" : String(i);
    if (key === shown) return;
    if (shown !== null) { q('[data-detail="' + shown + '"]').hidden = true; mark(shown, false); }
    var d = q('[data-detail="' + key + '"]') || q('[data-detail="none"]');
    d.hidden = false; shown = d.getAttribute("data-detail");
    if (shown !== "none") mark(shown, true);
  }
  function at(e) {
    var t = e.target.closest && e.target.closest("[data-cycle],[data-ref]");
    return t ? +(t.getAttribute("data-cycle") || t.getAttribute("data-ref")) : null;
  }
  document.addEventListener("mouseover", function (e) { var i = at(e); if (i !== null) show(i); });
  document.addEventListener("mouseout", function (e) { if (at(e) !== null) show(pinned); });
  document.addEventListener("click", function (e) {
    var i = at(e);
    if (i === null) return;
    pinned = pinned === i ? null : i; show(i);
    document.getElementById("details").classList.toggle("pinned", pinned !== null);
  });
  document.addEventListener("keydown", function (e) {
    if (!n || (e.key !== "ArrowRight" && e.key !== "ArrowLeft")) return;
    var i = pinned === null ? 0 : pinned + (e.key === "ArrowRight" ? 1 : -1);
    pinned = Math.max(0, Math.min(n - 1, i)); show(pinned);
    document.getElementById("details").classList.add("pinned");
    q('[data-cycle="' + pinned + '"]').scrollIntoView({block: "nearest"});
  });
  show(null);
})();
"""
