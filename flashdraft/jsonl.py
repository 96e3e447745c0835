"""Prompt files: JSONL, one JSON object per line (e.g. {"id": str, "turns": [str, ...]})."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from .errors import FlashdraftError


def read_records(path: str | Path) -> Iterator[tuple[str, dict]]:
    """Yield ("file:line", record) for every non-blank line; one-line errors for unreadable or malformed lines."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FlashdraftError(f"prompt file {path} not found; pass a JSONL file with {{\"turns\": [str, ...]}} records") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FlashdraftError(f"cannot read {path}: {e}") from None
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 may sit inside JSON strings
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise FlashdraftError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise FlashdraftError(f"{path}:{n}: expected a JSON object per line")
        yield f"{path}:{n}", rec
