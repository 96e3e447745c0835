"""A bench run: its results directory (samples.jsonl, run.json, resumable) and the loop over (dataset, prompt,
variant) that fills it."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ..atomic import write_text
from ..errors import FlashdraftError
from .datasets import Prompt, encode_turn
from .methods import BATCH_METHODS, METHODS, Sample
from .variants import Variant

limit_clock = time.monotonic  # what --limit-time is measured with (a seam for tests)


# ---------------------------------------------------------------- results directory

def load_records(path: Path) -> list[dict]:
    """Finished samples. Only a torn last line (a crash mid-append: no newline after it) may be unreadable: it is
    dropped with a warning and the file repaired; any other unreadable line is an error that changes nothing."""
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.split("\n")  # not splitlines(): U+2028 may sit inside JSON strings
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n < len(lines):  # a complete line (a newline follows it) that is not JSON: not ours to drop
                raise FlashdraftError(f"{path}:{n}: not a JSON record ({e.msg}); fix or remove that line, or use "
                                      "another --out") from None
            print(f"flashdraft: warning: {path}:{n}: dropped a torn last line (an interrupted write); its sample "
                  "runs again", file=sys.stderr)
            write_text(path, "\n".join(lines[:-1]) + "\n" if n > 1 else "")
    return records


def append_record(path: Path, record: dict) -> None:
    """Append one JSON line with a single write (line-atomic for one writer) and fsync."""
    data = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def check_results_dir(out: Path, config: dict, variants: dict[str, dict]) -> None:
    """Refuse to resume into a directory produced with different settings; record this run's settings."""
    path = out / "run.json"
    old = json.loads(path.read_text()) if path.is_file() else {"config": config, "variants": {}}
    if old["config"] != config:
        diff = sorted(k for k in set(config) | set(old["config"]) if config.get(k) != old["config"].get(k))
        raise FlashdraftError(f"{out} holds a run with different settings ({', '.join(diff)}); "
                              "use another --out or the same settings to resume")
    for label, desc in variants.items():
        if label in old["variants"] and old["variants"][label] != desc:
            raise FlashdraftError(f"{out}: method {label!r} was run with {old['variants'][label]}, now {desc}; "
                                  "use another --out")
    write_text(path, json.dumps({"config": config, "variants": {**old["variants"], **variants}}, indent=2) + "\n")


# ---------------------------------------------------------------- the run

def turn_record(target, s: Sample, prompt_len: int) -> dict:
    """The per-turn part of a per-sample JSONL record (with the cycles where the method records them)."""
    return {**({"cycles": s.cycles} if s.cycles is not None else {}), "prompt_len": prompt_len, "output_ids": s.output_ids, "text": target.decode(s.output_ids),
            "new_tokens": len(s.output_ids), "first_tokens": s.first_tokens, "ttft_s": s.ttft_s,
            "total_s": s.total_s, "decode_s": max(0.0, s.total_s - s.ttft_s),
            "acceptance_lengths": s.acceptance_lengths, "stages": s.stages, "lookup_cycles": s.lookup_cycles,
            "cycle_timing": s.draft_s is not None, "draft_s": s.draft_s, "verify_s": s.verify_s,
            "other_s": s.other_s}  # None where the method has no per-cycle split (missing, not zero)


def run_sample(target, v: Variant, p: Prompt, chat: bool) -> list[dict]:
    """All turns of one prompt with one method, each turn fed the method's own previous answers."""
    fn = METHODS[v.method]
    turns, answers, prev, prev_out = [], [], None, None
    for _ in p.turns:
        ids = encode_turn(target, p.turns, answers, prev, prev_out, chat)
        s = fn(target, ids, v.settings)
        turns.append(turn_record(target, s, len(ids)))
        answers.append(turns[-1]["text"])
        prev, prev_out = ids, s.output_ids
    return turns


def run_batch(target, v: Variant, ps: list[Prompt], chat: bool) -> list[list[dict]]:
    """All turns of prompts decoded together by a batched method: turn k of every prompt that has one in one batch,
    each fed its own previous answers."""
    turns: list[list[dict]] = [[] for _ in ps]
    answers: list[list[str]] = [[] for _ in ps]
    prev: list = [(None, None) for _ in ps]
    for k in range(max(len(p.turns) for p in ps)):
        live = [i for i, p in enumerate(ps) if k < len(p.turns)]
        ids = [encode_turn(target, ps[i].turns, answers[i], *prev[i], chat) for i in live]
        for i, x, s in zip(live, ids, BATCH_METHODS[v.method](target, ids, v.settings)):
            turns[i].append(turn_record(target, s, len(x)))
            answers[i].append(turns[i][-1]["text"])
            prev[i] = (x, s.output_ids)
    return turns


def warm_up(target, variants: list[Variant], p: Prompt, chat: bool) -> None:
    """One short untimed generation per method so none pays first-call costs in the measurement."""
    ids = target.encode(p.turns[0], chat=chat)
    for v in variants:
        METHODS[v.method](target, ids, v.settings.shortened(16))


def progress():
    """A rich progress bar on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True), transient=False)


class Runner:
    """The progress bar, the time limit and the records file of one bench run."""

    def __init__(self, path: Path, total: int, limit_time: float | None):
        self.path, self.total, self.limit_time, self.n = path, total, limit_time, 0
        self.t_start, self.bar = limit_clock(), progress()
        self.plain = not self.bar.console.is_terminal
        self.task = self.bar.add_task("bench", total=total)

    def over_time(self) -> str | None:
        """Why no new run may start (the time limit), or None."""
        if self.limit_time is not None and limit_clock() - self.t_start >= self.limit_time:
            return f"time limit of {self.limit_time:g}s reached after {self.n} of {self.total} runs"
        return None

    def label(self, text: str) -> None:
        from rich.markup import escape

        self.bar.update(self.task, description=escape(text))

    def record(self, ds: str, p: Prompt, v: Variant, turns: list[dict]) -> None:
        """Append one finished sample and advance."""
        append_record(self.path, {"dataset": ds, "id": p.id, "method": v.label, "turns": turns})
        self.n += 1
        self.bar.advance(self.task)
        if self.plain:
            toks = sum(t["new_tokens"] for t in turns)
            dec = sum(t["decode_s"] for t in turns)
            print(f"[{self.n}/{self.total}] {ds} {p.id} {v.label}: {toks} tokens, "
                  f"{sum(t['new_tokens'] - t['first_tokens'] for t in turns) / max(dec, 1e-9):.1f} tok/s",
                  file=sys.stderr, flush=True)


def run_solo(target, todo: list[tuple[str, Prompt, Variant]], run: Runner, chat: bool) -> str | None:
    """Every (dataset, prompt, method) in order, one sample at a time, after one warm-up per method."""
    if todo:
        warm_up(target, list({v.label: v for _, _, v in todo}.values()), todo[0][1], chat)
    for ds, p, v in todo:
        if stopped := run.over_time():
            return stopped
        run.label(f"{ds} · {v.label} · {p.id}")
        run.record(ds, p, v, run_sample(target, v, p, chat))
    return None


def run_batched(target, v: Variant, pending: dict[str, list[Prompt]], run: Runner, chat: bool) -> str | None:
    """A batched method's pending prompts, v.settings.batch at a time per dataset, after its own warm-up; its engine
    is closed afterwards (one at a time: a vLLM engine holds its threads and KV cache)."""
    first = next((ps[0] for ps in pending.values() if ps), None)
    try:
        if first is not None:
            warm_up(target, [v], first, chat)
        for ds, ps in pending.items():
            for i in range(0, len(ps), v.settings.batch):
                if stopped := run.over_time():
                    return stopped
                chunk = ps[i: i + v.settings.batch]
                run.label(f"{ds} · {v.label} · {chunk[0].id}…")
                for p, turns in zip(chunk, run_batch(target, v, chunk, chat)):
                    run.record(ds, p, v, turns)
    finally:
        if v.settings.engine is not None:
            v.settings.engine.close()
    return None


def run_bench(target, datasets: dict[str, list[Prompt]], variants: list[Variant], out: Path, chat: bool,
              limit_time: float | None) -> str | None:
    """Run every (dataset, prompt, method) not yet in samples.jsonl; returns why it stopped early, or None."""
    path = out / "samples.jsonl"
    done = {(r["dataset"], r["id"], r["method"]) for r in load_records(path)}
    todo = [(ds, p, v) for ds, ps in datasets.items() for p in ps for v in variants
            if v.method not in BATCH_METHODS and (ds, p.id, v.label) not in done]
    batched = [(v, {ds: [p for p in ps if (ds, p.id, v.label) not in done] for ds, ps in datasets.items()})
               for v in variants if v.method in BATCH_METHODS]
    total = len(todo) + sum(len(ps) for _, pending in batched for ps in pending.values())
    if not total:
        return None
    run = Runner(path, total, limit_time)
    with run.bar:
        stopped = run_solo(target, todo, run, chat)
        for v, pending in batched:
            stopped = stopped or run_batched(target, v, pending, run, chat)
    return stopped
