"""The token store: every prompt and answer the target generated, kept in the repository (docs/data.md).

    STORE/manifest.json      {"format": "flashdraft-tokens-v1", "shards": [entry, ...]}, one line per shard
    STORE/shards/SOURCE-NNNNN.safetensors.xz    an xz-compressed safetensors file:
        prompt_ids     uint16 [P]   prompts (chat template applied), concatenated; uint32 beyond 65,536 ids
        response_ids   uint16 [R]   the target's answers, each up to and including its stop token
        prompt_lens    uint32 [S]
        response_lens  uint32 [S]
        finished       uint8 [S]    1: the answer ended with a stop token, 0: cut at max_new_tokens
    STORE/dev/SOURCE.jsonl   each source's held-out prompts (never generated; `train` measures dev τ on them)

A manifest entry: file, sha256 and bytes of the file, source, target (name), target_sha256 (target_sha256()),
settings (temperature, max_new_tokens, dtype, seed, chat: what decides the answers), device, sequences,
prompt_tokens, response_tokens, unfinished, prompt_index ([first, last] position in the source as read) and
prompt_keys (prompt_key() per sequence, in order). Shards are only ever added, so a committed file never changes;
a prompt answered by the same target checksum with the same settings, at whichever dtype, is never generated again
(answers at float32 and bfloat16 differ only where logits nearly tie: one answer per prompt is what training wants).
Features are recomputed from the ids when training, never stored.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from .. import target as T
from ..atomic import write_bytes, write_text
from ..errors import FlashdraftError
from .data import (PREFIX_CACHE_MIB, Sequence, answer_chunks, check_alike, check_prepare_settings, data_dirs,
                   dev_jsonl, human_bytes, interleave, load_sequences, read_meta)
from .prompts import Conversation, encode_prompt, prompt_key

STORE_FORMAT = "flashdraft-tokens-v1"
MANIFEST = "manifest.json"
MIB = 1 << 20
CAP_MIB = 64.0  # the repository keeps the whole store; beyond this it belongs elsewhere
# LZMA2 with literal/position bits for 2-byte symbols: 1.5% smaller than the defaults on uint16 token ids
XZ_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 6, "lc": 0, "lp": 1, "pb": 1}]
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass
class Source:
    """A named prompt source: its training prompts with their positions in the source as read, and its dev split."""

    name: str
    items: list[tuple[int, Conversation]]
    dev: list[Conversation]


@dataclass
class Todo:
    """A prompt to answer: where it came from, its identity and its ids."""

    source: str
    index: int
    key: str
    ids: list[int]


# ---------------------------------------------------------------- the manifest

def is_store(path: str | Path) -> bool:
    """Whether path is a token store (it has a manifest.json; prepared directories have meta.json)."""
    return (Path(path) / MANIFEST).is_file()


def read_manifest(store: str | Path) -> dict:
    """STORE/manifest.json, checked."""
    file = Path(store) / MANIFEST
    if not file.is_file():
        raise FlashdraftError(f"{store} is not a token store (no {MANIFEST}); make one with flashdraft prepare "
                              f"{store} --store")
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, OSError, UnicodeDecodeError) as e:
        raise FlashdraftError(f"{file} is unreadable ({e}); restore it with git checkout -- {file}") from None
    ok = (isinstance(manifest, dict) and manifest.get("format") == STORE_FORMAT
          and isinstance(manifest.get("shards"), list))
    if not ok:
        raise FlashdraftError(f"{file}: not a {STORE_FORMAT} manifest")
    return manifest


def manifest_text(manifest: dict) -> str:
    """The manifest with one line per shard, so that adding a shard adds one line to the diff."""
    lines = ",\n".join("    " + json.dumps(e, ensure_ascii=False) for e in manifest["shards"])
    return (f'{{\n  "format": {json.dumps(manifest["format"])},\n  "shards": ['
            + (f"\n{lines}\n  " if lines else "") + "]\n}\n")


@contextmanager
def locked(store: Path) -> Iterator[None]:
    """Hold the store's lock (flock on its directory): `prepare --part` processes append one at a time."""
    import fcntl

    fd = os.open(store, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def store_bytes(store: str | Path) -> int:
    """Bytes of every file in the store: what the repository carries."""
    return sum(f.stat().st_size for f in Path(store).rglob("*") if f.is_file())


def open_store(store: Path) -> None:
    """Create an empty store, or clean up one that exists: leftovers of killed writers (scratch files, shard files
    the manifest does not list: killed between the shard's rename and the manifest's) are removed."""
    if not is_store(store):
        if store.exists() and (not store.is_dir() or any(store.iterdir())):
            raise FlashdraftError(f"{store} exists and is not a token store; choose an empty or new directory")
        store.mkdir(parents=True, exist_ok=True)
    with locked(store):
        if not is_store(store):
            write_text(store / MANIFEST, manifest_text({"format": STORE_FORMAT, "shards": []}))
        listed = {e.get("file") for e in read_manifest(store)["shards"]}
        for f in list(store.rglob("*")):
            scratch = f.name.startswith(".") and f.name.endswith(".tmp")
            if f.is_file() and (scratch or (f.parent.name == "shards" and f"shards/{f.name}" not in listed)):
                f.unlink()


# ---------------------------------------------------------------- identity of the answers

def target_sha256(model) -> str:
    """sha256 of the target's parameter names, shapes and values rounded to bfloat16: one checkpoint has one checksum
    whether loaded in float32 or bfloat16 (the dtype is a generation setting of its own)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):  # tied weights appear once
        h.update(f"{name}:{tuple(p.shape)};".encode())
        h.update(p.detach().to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy())
    return h.hexdigest()


def generation_settings(model, max_new_tokens: int, temperature: float, seed: int, chat: bool) -> dict:
    """What decides the answers besides the weights (the seed only when sampling)."""
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return {"temperature": float(temperature), "max_new_tokens": max_new_tokens, "dtype": dtype,
            "seed": seed if temperature > 0 else None, "chat": chat}


def answer_key(settings: dict) -> str:
    """The settings that ask for a prompt's answer, as one string: all but the dtype, which is recorded but only
    moves the answers at near-ties (a store grown at float32 goes on at bfloat16 where that is faster, docs/data.md)."""
    return json.dumps({k: v for k, v in settings.items() if k != "dtype"}, sort_keys=True)


def done_keys(manifest: dict, target_sha: str, settings: dict) -> set[str]:
    """Prompts already answered by this target with these settings, at any dtype."""
    key = answer_key(settings)
    return {k for e in manifest["shards"] if e["target_sha256"] == target_sha and answer_key(e["settings"]) == key
            for k in e["prompt_keys"]}


# ---------------------------------------------------------------- shard files

def shard_bytes(seqs: list[Sequence], vocab: int) -> tuple[bytes, dict]:
    """One shard file's bytes and its counts."""
    from safetensors.numpy import save

    n_resp = [int(s.loss_mask.sum()) for s in seqs]
    ids = [s.input_ids.numpy() for s in seqs]
    top = max(vocab, max(int(i.max()) for i in ids) + 1)
    dt = np.uint16 if top <= 1 << 16 else np.uint32
    arrays = {"prompt_ids": np.concatenate([i[: len(i) - r] for i, r in zip(ids, n_resp)]).astype(dt),
              "response_ids": np.concatenate([i[len(i) - r:] for i, r in zip(ids, n_resp)]).astype(dt),
              "prompt_lens": np.array([len(i) - r for i, r in zip(ids, n_resp)], dtype=np.uint32),
              "response_lens": np.array(n_resp, dtype=np.uint32),
              "finished": np.array([s.finished for s in seqs], dtype=np.uint8)}
    data = lzma.compress(save(arrays, metadata={"format": STORE_FORMAT}), format=lzma.FORMAT_XZ, filters=XZ_FILTERS)
    counts = {"sequences": len(seqs), "prompt_tokens": int(arrays["prompt_lens"].sum()),
              "response_tokens": sum(n_resp), "unfinished": sum(not s.finished for s in seqs)}
    return data, counts


def read_store_shard(store: str | Path, entry: dict) -> list[Sequence]:
    """The sequences of one shard, after checking the file against the manifest's sha256."""
    from safetensors.numpy import load

    file = Path(store) / entry["file"]
    try:
        data = file.read_bytes()
    except OSError:
        raise FlashdraftError(f"{file} is listed in {MANIFEST} but missing; restore it with "
                              f"git checkout -- {file}") from None
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise FlashdraftError(f"{file}: sha256 does not match {MANIFEST} (corrupted or changed); restore it with "
                              f"git checkout -- {file}")
    t = load(lzma.decompress(data))
    p_off = np.concatenate([[0], np.cumsum(t["prompt_lens"], dtype=np.int64)])
    r_off = np.concatenate([[0], np.cumsum(t["response_lens"], dtype=np.int64)])
    prompts, responses = t["prompt_ids"].astype(np.int64), t["response_ids"].astype(np.int64)
    out = []
    for k, fin in enumerate(t["finished"].tolist()):
        p, r = prompts[p_off[k]:p_off[k + 1]], responses[r_off[k]:r_off[k + 1]]
        ids = torch.from_numpy(np.concatenate([p, r]))
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(p):] = True
        out.append(Sequence(ids, mask, finished=bool(fin)))
    if len(out) != entry["sequences"]:
        raise FlashdraftError(f"{file} holds {len(out)} sequences, {MANIFEST} says {entry['sequences']}")
    return out


def next_file(manifest: dict, source: str) -> str:
    """The first free shards/SOURCE-NNNNN name."""
    taken = {e["file"] for e in manifest["shards"]}
    n = sum(e["source"] == source for e in manifest["shards"])
    while f"shards/{source}-{n:05d}.safetensors.xz" in taken:
        n += 1
    return f"shards/{source}-{n:05d}.safetensors.xz"


def cap_error(store: Path, size: int, cap: int, what: str) -> FlashdraftError:
    return FlashdraftError(f"{what} would grow the token store {store} to {size / MIB:.1f} MiB, beyond its cap of "
                           f"{cap / MIB:g} MiB (--store-cap-mib); the repository keeps all of it, so stop here or "
                           "start a store outside the repository")


def append_shard(store: Path, source: str, seqs: list[Sequence], todo: list[Todo], info: dict, vocab: int,
                 cap: int) -> dict:
    """Write one shard and its manifest entry (under the lock, each file atomically); refuse to pass the cap."""
    data, counts = shard_bytes(seqs, vocab)
    with locked(store):
        manifest = read_manifest(store)
        entry = {"file": next_file(manifest, source), "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                 "source": source, **info, **counts, "prompt_index": [min(t.index for t in todo),
                                                                     max(t.index for t in todo)],
                 "prompt_keys": [t.key for t in todo]}
        manifest["shards"].append(entry)
        text = manifest_text(manifest)
        size = store_bytes(store) + len(data) + len(text.encode()) - (store / MANIFEST).stat().st_size
        if size > cap:
            raise cap_error(store, size, cap, f"shard {entry['file']} ({len(data) / MIB:.2f} MiB)")
        write_bytes(store / entry["file"], data)  # the shard first: a manifest never lists a missing file
        write_text(store / MANIFEST, text)
    return entry


# ---------------------------------------------------------------- --data: prepared directories and token stores

def check_data(path: str | Path) -> None:
    """A prepared directory or a token store (one-line error otherwise); read before any model is loaded."""
    read_manifest(path) if is_store(path) else read_meta(path)


def load_data(data: str | list[str], features: bool = False, topk: bool = False, sources: list[str] | None = None,
              target_sha: str | None = None) -> list[Sequence]:
    """data.load_all over prepared directories and token stores, in order; stores give ids only, of `sources`
    (default all) made by the target `target_sha`."""
    dirs = data_dirs(data)
    stores = [d for d in dirs if is_store(d)]
    if stores and (features or topk):
        raise FlashdraftError(f"{stores[0]} is a token store: it keeps ids only (features and top-k are recomputed, "
                              "never stored); train online, without --offline and --distill-weight")
    check_alike([d for d in dirs if d not in stores], features)
    return [s for d in dirs for s in (load_store(d, sources, target_sha) if d in stores
                                      else load_sequences(d, features, topk))]


def dev_files(data: str | list[str], sources: list[str] | None = None) -> list[Path]:
    """The held-out prompt files of --data: DIR/dev.jsonl, and STORE/dev/SOURCE.jsonl of the chosen sources."""
    out: list[Path] = []
    for d in data_dirs(data):
        if is_store(d):
            out += store_dev_files(d, sources)
        elif (Path(d) / "dev.jsonl").is_file():
            out.append(Path(d) / "dev.jsonl")
    return out


# ---------------------------------------------------------------- reading for training

def load_store(store: str | Path, sources: list[str] | None = None, target_sha: str | None = None) -> list[Sequence]:
    """The sequences of the shards of `sources` (default all) made by target `target_sha` (default: the only one)."""
    manifest = read_manifest(store)
    have = sorted({e["source"] for e in manifest["shards"]})
    entries = [e for e in manifest["shards"] if not sources or e["source"] in sources]
    if not entries:
        raise FlashdraftError(f"token store {store} holds no shards{f' of sources {sources}' if sources else ''}; "
                              f"it has: {', '.join(have) or 'nothing yet (run flashdraft prepare --store)'}")
    shas = sorted({e["target_sha256"] for e in entries})
    if target_sha is None and len(shas) > 1:
        raise FlashdraftError(f"token store {store} holds shards of {len(shas)} targets; choose sources of one")
    mine = [e for e in entries if target_sha is None or e["target_sha256"] == target_sha]
    if not mine:
        raise FlashdraftError(f"token store {store} holds no shards made by this target (checksum "
                              f"{target_sha[:12]}…; the store has {', '.join(s[:12] + '…' for s in shas)}); "
                              "load the target the shards were generated with")
    return [s for e in mine for s in read_store_shard(store, e)]


def store_dev_files(store: str | Path, sources: list[str] | None = None) -> list[Path]:
    """STORE/dev/SOURCE.jsonl of the chosen sources (default all), by name."""
    return sorted(f for f in (Path(store) / "dev").glob("*.jsonl") if not sources or f.stem in sources)


def store_summary(store: Path, target_sha: str | None = None, settings: dict | None = None) -> dict:
    """Counts from the manifest: all shards, and those of one target and settings (at any dtype)."""
    shards = read_manifest(store)["shards"]
    key = answer_key(settings or {})
    mine = [e for e in shards
            if target_sha is None or (e["target_sha256"] == target_sha and answer_key(e["settings"]) == key)]
    by_source: dict[str, int] = {}
    for e in mine:
        by_source[e["source"]] = by_source.get(e["source"], 0) + e["sequences"]
    return {"shards": len(shards), "bytes": store_bytes(store), "sequences": sum(e["sequences"] for e in mine),
            "response_tokens": sum(e["response_tokens"] for e in mine),
            "unfinished": sum(e["unfinished"] for e in mine), "by_source": by_source}


# ---------------------------------------------------------------- prepare into a store

def write_store_dev(store: Path, sources: list[Source]) -> None:
    """STORE/dev/SOURCE.jsonl for each source with held-out prompts (rewritten only when it changes)."""
    for s in sources:
        file, text = store / "dev" / f"{s.name}.jsonl", dev_jsonl(s.dev)
        if s.dev and (not file.is_file() or file.read_text() != text):
            write_text(file, text)


def select(target, sources: list[Source], done: set[str], *, max_samples: int | None, limit: int,
           chat: bool) -> tuple[list[Todo], int, int]:
    """The first max_samples distinct prompts of the interleaved sources that fit `limit` prompt tokens: (those not
    yet answered, how many were, how many longer ones were dropped); prompts are tokenized only when needed."""
    todo: list[Todo] = []
    seen: set[str] = set()
    n_done = dropped = 0
    for name, index, prompt in interleave([[(s.name, i, p) for i, p in s.items] for s in sources]):
        if max_samples is not None and n_done + len(todo) >= max_samples:
            break
        key = prompt_key(prompt)
        if key in seen:  # the same prompt twice (in one source or two): one answer
            continue
        seen.add(key)
        if key in done:
            n_done += 1
            continue
        ids = encode_prompt(target, prompt, chat)
        if len(ids) > limit:
            dropped += 1
            continue
        todo.append(Todo(name, index, key, ids))
    return todo, n_done, dropped


def shard_chunks(todo: list[Todo], sources: list[Source], shard_size: int, part: tuple[int, int]) -> list[list[Todo]]:
    """One source per shard, shards of the sources interleaved. --part I/N keeps the prompts whose key is I mod N: a
    split that stays put while other parts finish theirs, so a part resumed later still takes only its own."""
    mine = [t for t in todo if int(t.key, 16) % part[1] == part[0]]
    per_source = [[t for t in mine if t.source == s.name] for s in sources]
    return interleave([[ts[i:i + shard_size] for i in range(0, len(ts), shard_size)] for ts in per_source])


def prepare_store(target, sources: list[Source], store: str | Path, *, max_samples: int | None = None,
                  max_prompt_tokens: int | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
                  batch_size: int = 16, shard_size: int = 256, seed: int = 0, chat: bool = True,
                  part: tuple[int, int] = (0, 1), cap_mib: float = CAP_MIB,
                  prefix_cache_mib: float = PREFIX_CACHE_MIB, progress: bool = True, log: Callable[[str], None] | None = None) -> dict:
    """Answer the sources' prompts not yet in the store (same target checksum and settings) and append them as
    shards; returns store_summary() plus this run's generated tokens, seconds and rate."""
    from tqdm import tqdm

    log = log or (lambda msg: print(f"flashdraft: {msg}", file=sys.stderr))
    check_prepare_settings(max_new_tokens, batch_size, shard_size, temperature, 0)
    check_sources(sources)
    store, cap = Path(store), int(cap_mib * MIB)
    open_store(store)
    if (used := store_bytes(store)) >= cap:
        raise cap_error(store, used, cap, "any new shard")
    with locked(store):
        write_store_dev(store, sources)
    model = target.model
    sha, settings = target_sha256(model), generation_settings(model, max_new_tokens, temperature, seed, chat)
    limit = T.context_limit(model) - max_new_tokens
    limit = min(limit, max_prompt_tokens) if max_prompt_tokens else limit
    todo, n_done, dropped = select(target, sources, done_keys(read_manifest(store), sha, settings),
                                   max_samples=max_samples, limit=limit, chat=chat)
    chunks = shard_chunks(todo, sources, shard_size, part)
    log(f"{store}: {n_done} of the {n_done + len(todo)} prompts chosen were answered before by this target "
        f"({sha[:12]}…) with these settings; {sum(map(len, chunks))} to answer in {len(chunks)} shard(s)"
        + (f"; dropped {dropped} longer than {limit} prompt tokens" if dropped else ""))
    info = {"target": target.name, "target_sha256": sha, "settings": settings,
            "device": next(model.parameters()).device.type}
    bar = tqdm(total=sum(map(len, chunks)), unit="seq", disable=not progress, dynamic_ncols=True, desc="prepare",
               smoothing=0.05)
    t0, new_tokens = time.perf_counter(), 0
    for k, seqs in answer_chunks(target, [[t.ids for t in c] for c in chunks], rows=batch_size,
                                 max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, layer_ids=None,
                                 topk=0, bar=bar, prefix_cache_mib=prefix_cache_mib):
        append_shard(store, chunks[k][0].source, seqs, chunks[k], info, T.vocab_size(model), cap)
        new_tokens += sum(int(s.loss_mask.sum()) for s in seqs)
    bar.close()
    seconds = time.perf_counter() - t0
    return {**store_summary(store, sha, settings), "target_sha256": sha, "dropped": dropped, "seconds": seconds,
            "generated_tokens_this_run": new_tokens, "tokens_per_s": new_tokens / seconds if seconds > 0 else 0.0}


def check_sources(sources: list[Source]) -> None:
    """Source names become file names and filters: simple and distinct."""
    names = [s.name for s in sources]
    for n in names:
        if not SOURCE_NAME.fullmatch(n):
            raise FlashdraftError(f"source name {n!r} must be letters, digits, '_', '.' or '-' (name a file NAME=FILE)")
    if len(set(names)) != len(names):
        raise FlashdraftError(f"two sources share a name ({', '.join(names)}); name one with --prompts NAME=FILE")


def describe(summary: dict, store: Path, cap_mib: float = CAP_MIB) -> str:
    """The closing line of prepare --store."""
    rate = (f"; this run: {summary['generated_tokens_this_run']} response tokens, {summary['tokens_per_s']:.1f} "
            f"generated tok/s over {summary['seconds']:.0f} s" if summary.get("generated_tokens_this_run") else "")
    sources = ", ".join(f"{k} {v}" for k, v in summary["by_source"].items())
    return (f"token store {store}: {summary['sequences']} sequences of this target and settings ({sources or 'none'}; "
            f"{summary['response_tokens']} response tokens, {summary['unfinished']} cut at --max-new-tokens), "
            f"{summary['shards']} shard{'s' * (summary['shards'] != 1)} in all, {human_bytes(summary['bytes'])} of its "
            f"{cap_mib:g} MiB cap{rate}")
