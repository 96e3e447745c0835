"""`flashdraft trace`: a generate record or a bench sample → one self-contained HTML page; generate/bench hooks."""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path

from ..bench.methods import HF_METHODS
from ..engines import ENGINES
from ..errors import FlashdraftError
from ..jsonl import read_records
from ..trace import TokenText, bench_turn, record_tau, write_trace

# baselines: nothing drafted, nothing to trace (each engine's plain method, and transformers' own)
PLAIN_METHODS = {e.plain_method for e in ENGINES.values()} | set(HF_METHODS)


def add_trace(sub) -> None:
    """Register `flashdraft trace` on an argparse subparsers object."""
    p = sub.add_parser("trace", help="write an HTML page showing where each cycle's drafts were kept or rejected",
                       description="Render a `flashdraft generate --json` record (or one sample of a bench "
                                   "samples.jsonl) as one self-contained HTML page: the text with every cycle marked, "
                                   "each cycle's drafts, kept prefix, first rejected draft and the target's token, "
                                   "draft trees, τ and plots.")
    p.add_argument("record", help="a `generate --json` record, or a bench samples.jsonl")
    p.add_argument("-o", "--out", required=True, help="HTML file to write (atomically)")
    p.add_argument("--target", help="whose tokenizer renders the tokens (default: the bench run's target, else "
                                    "smollm2-135m-instruct); token ids are shown when it has none")
    p.add_argument("--id", help="bench samples.jsonl: the sample id")
    p.add_argument("--method", help="bench samples.jsonl: the method label (e.g. dflash2)")
    p.add_argument("--dataset", help="bench samples.jsonl: the dataset label, where ids repeat across datasets")
    p.add_argument("--turn", type=int, default=1, help="bench samples.jsonl: which turn of the sample (default 1)")
    p.set_defaults(func=cmd_trace)


def cmd_trace(args) -> int:
    """`flashdraft trace RECORD -o FILE.html`."""
    records = read_input(Path(args.record))
    record = pick_record(records, args.id, args.method, args.dataset)
    page_record = bench_turn(record, args.turn) if "turns" in record else record
    name = args.target or bench_target(Path(args.record))
    out = write_trace(page_record, args.out, token_text_for(load_tokenizer(name)))
    print(f"flashdraft: wrote {out} ({len(page_record.get('acceptance_lengths') or [])} cycles)", file=sys.stderr)
    return 0


def read_input(path: Path) -> list[dict]:
    """The record(s) in a file: one JSON object (pretty-printed or not), or JSON lines."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FlashdraftError(f"record file {path} not found; write one with `flashdraft generate ... --json > "
                              f"{path}` or pass a bench samples.jsonl") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FlashdraftError(f"cannot read {path}: {e}") from None
    try:
        one = json.loads(text)
    except json.JSONDecodeError:
        one = None
    if isinstance(one, dict):
        return [one]
    records = [r for _, r in read_records(path)]
    if not records:
        raise FlashdraftError(f"{path} holds no record; pass a `generate --json` record or a bench samples.jsonl")
    return records


def pick_record(records: list[dict], sample_id: str | None, method: str | None, dataset: str | None) -> dict:
    """The one record matching --id / --method / --dataset (all optional when the file holds one record)."""
    keys = {"id": sample_id, "method": method, "dataset": dataset}
    if len(records) == 1 and not any(keys.values()):
        return records[0]
    found = [r for r in records if all(v is None or str(r.get(k)) == v for k, v in keys.items())]
    if len(found) == 1:
        return found[0]
    if not found:
        asked = " ".join(f"--{k} {v}" for k, v in keys.items() if v is not None) or "no --id/--method"
        have = sorted({str(r.get("method")) for r in records})
        raise FlashdraftError(f"no sample matches {asked}; methods in the file: {', '.join(have)}")
    some = ", ".join(f"{r.get('dataset')}/{r.get('id')}/{r.get('method')}" for r in found[:4])
    raise FlashdraftError(f"{len(found)} samples match ({some}{', …' if len(found) > 4 else ''}); pick one with "
                          "--id and --method (and --dataset)")


def bench_target(path: Path) -> str | None:
    """The target a bench run used (its run.json beside samples.jsonl), or None."""
    try:
        return json.loads((path.parent / "run.json").read_text())["config"]["target"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_tokenizer(name: str | None):
    """The target's tokenizer (registered name, local directory or hub id), or None (with a note) if it has none."""
    from transformers import AutoTokenizer

    from ..models import resolve_target

    try:
        path = resolve_target(name)
        return AutoTokenizer.from_pretrained(path, local_files_only=Path(path).is_dir())
    except (OSError, ValueError, TypeError, FlashdraftError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"flashdraft: no tokenizer for {name or 'the default target'} ({first}); showing token ids",
              file=sys.stderr)
        return None


def token_text_for(tokenizer) -> TokenText:
    """A token → text function: the tokenizer's decoding of the single token (specials kept), else `[id]`."""
    if tokenizer is None:
        return lambda tok: f"[{tok}]"

    @lru_cache(maxsize=None)
    def text(tok: int) -> str:
        try:
            return tokenizer.decode([tok], skip_special_tokens=False)
        except (ValueError, TypeError, IndexError, OverflowError):
            return f"[{tok}]"

    return text


def trace_for_generate(record: dict, target, path: str | Path) -> Path:
    """`generate --trace FILE.html`: write the page for a `generate` record with a loaded Target's tokenizer."""
    return write_trace(record, path, token_text_for(getattr(target, "tokenizer", None)))


def lowest_tau(records: list[dict], n: int) -> list[dict]:
    """The n bench sample records with the lowest τ (drafting methods only; ties keep file order)."""
    if n < 0:
        raise FlashdraftError(f"--trace needs a count >= 0, got {n}")
    scored = [(tau, i, r) for i, r in enumerate(records)
              if str(r.get("method", "")).split("[")[0] not in PLAIN_METHODS and (tau := record_tau(r)) is not None]
    return [r for _, _, r in sorted(scored, key=lambda x: x[:2])[:n]]


def trace_name(record: dict) -> str:
    """A file name for a bench sample's page: dataset-id-method.html with unsafe characters replaced."""
    raw = f"{record.get('dataset')}-{record.get('id')}-{record.get('method')}"
    return "".join(ch if ch.isalnum() or ch in "-_.,=" else "_" for ch in raw) + ".html"


def trace_bench(records: list[dict], target, out_dir: str | Path, n: int) -> list[Path]:
    """`bench --trace N`: pages for the n samples with the lowest τ (each sample's lowest-τ turn) under out_dir."""
    tt = token_text_for(getattr(target, "tokenizer", None))
    paths = []
    for r in lowest_tau(records, n):
        taus = [record_tau(t) for t in r["turns"]]
        turn = min(range(len(taus)), key=lambda i: (taus[i] is None, taus[i] or 0.0)) + 1
        paths.append(write_trace(bench_turn(r, turn), Path(out_dir) / trace_name(r), tt))
    return paths
