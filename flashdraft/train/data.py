"""Training data: prompts → target-generated responses → token shards (optionally with target features).

On-disk layout of `flashdraft prepare OUT` (all writes atomic; a re-run skips every shard whose stored
prompt hash matches the prompts it would get now, so a run can be resumed or extended with a larger --max-samples):

    OUT/meta.json                    settings the shards were made with (checked on resume)
    OUT/shard_00000/tokens.safetensors
        input_ids  int32 [N]         prompt (chat template applied) + response, sequences concatenated
        loss_mask  uint8 [N]         1 on response tokens (up to and including the stop token)
        offsets    int64 [S + 1]     sequence s is input_ids[offsets[s]:offsets[s+1]]
        finished   uint8 [S]         1 if the response ended with a stop token (0: cut at max_new_tokens)
    OUT/shard_00000/features.safetensors   (only with --features)
        features   bfloat16 [N, len(layer_ids) * hidden]   hidden_states[i + 1] for i in layer_ids, per position
    OUT/shard_00000/topk.safetensors       (only with --topk K: the target's distribution, for distillation)
        ids        int32 [N, K]       row t: the K most likely tokens of the distribution that produced token t
        logprobs   float16 [N, K]     their log-probabilities (not renormalised); rows outside loss_mask are 0
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .. import target as T
from ..atomic import atomic_dir, write_text
from ..decoding import DecodeSettings, decode_stream
from ..errors import FlashdraftError
from ..jsonl import read_records
from .prompts import PROMPT_KEYS, Conversation, encode_prompt, first_turn

DATA_FORMAT = "flashdraft-data-v1"
PREFIX_CACHE_MIB = 2048.0  # recent prompts' prefill K/V kept: later turns of a conversation prefill only their new part


@dataclass
class Sequence:
    """One training example: token ids [n], loss mask [n] (response tokens) and optional features [n, F]."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    features: torch.Tensor | None = None
    finished: bool = True  # False when the response hit max_new_tokens before a stop token
    topk_ids: torch.Tensor | None = None  # [n, K] int32; row t is the target's top-K for predicting token t
    topk_logprobs: torch.Tensor | None = None  # [n, K] float16


# ---------------------------------------------------------------- prompts

def prompt_of(record: dict, where: str) -> str:
    """The first user turn of a record: `turns[0]`, chat `messages`, or a prompt-like field."""
    if isinstance(record.get("turns"), list) and record["turns"]:
        return str(record["turns"][0])
    for key in ("messages", "conversations"):
        msgs = record.get(key)
        if isinstance(msgs, list):
            for m in msgs:
                if isinstance(m, dict) and m.get("role", m.get("from")) in ("user", "human"):
                    return str(m.get("content", m.get("value", "")))
    for key in PROMPT_KEYS:
        if isinstance(record.get(key), str):
            return record[key]
    raise FlashdraftError(f"{where}: no prompt found (expected 'turns': [str, ...] or one of {list(PROMPT_KEYS)})")


def read_jsonl_prompts(path: str | Path) -> list[str]:
    """First turns of every record in a JSONL file."""
    out = []
    for where, rec in read_records(path):
        prompt = prompt_of(rec, where)
        if prompt.strip():  # an empty first turn has nothing to answer
            out.append(prompt)
    if not out:
        raise FlashdraftError(f"prompt file {path} has no records")
    return out


def read_dataset_prompts(name: str, split: str = "train", config: str | None = None) -> list[str]:
    """First user turns of a Hugging Face `datasets` dataset (needs the [data] extra)."""
    try:
        import datasets
    except ImportError:
        raise FlashdraftError("--dataset needs the `datasets` package: pip install 'flashdraft[data]'") from None
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises many types; report one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FlashdraftError(f"could not load dataset {name!r} split {split!r}: {first}") from None
    return [p for i, rec in enumerate(ds) if (p := prompt_of(rec, f"{name}[{i}]")).strip()]


def in_dev_split(prompt: Conversation, percent: float) -> bool:
    """A fixed, order-independent hold-out: the hash of the first turn decides, so adding sources never moves a
    prompt and every context of one conversation falls on the same side."""
    return int(hashlib.sha256(first_turn(prompt).encode()).hexdigest()[:8], 16) % 10_000 < percent * 100


def split_dev(prompts: list[Conversation], percent: float) -> tuple[list[Conversation], list[Conversation]]:
    """(training prompts, dev prompts): the dev split is never generated or trained on; it is for measuring τ."""
    held = [in_dev_split(p, percent) for p in prompts]
    return [p for p, h in zip(prompts, held) if not h], [p for p, h in zip(prompts, held) if h]


def dev_jsonl(dev: list[Conversation]) -> str:
    """Held-out prompts as {"turns": [first turn]} lines (dev τ decodes first turns), each first turn once."""
    firsts = list(dict.fromkeys(first_turn(p) for p in dev))
    return "".join(json.dumps({"id": f"dev-{i}", "turns": [p]}) + "\n" for i, p in enumerate(firsts))


def write_dev(out_dir: str | Path, dev: list[Conversation]) -> None:
    """OUT/dev.jsonl: the held-out prompts."""
    write_text(Path(out_dir) / "dev.jsonl", dev_jsonl(dev))


def interleave(lists: list[list]) -> list:
    """Round-robin merge so every prefix mixes all sources."""
    out, n = [], max((len(x) for x in lists), default=0)
    for i in range(n):
        out.extend(x[i] for x in lists if i < len(x))
    return out


# ---------------------------------------------------------------- generation

PASS_TOKENS = 8192  # padded positions per teacher-forced forward (features, top-k): bounds its activations


def right_pad(seqs: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Id tensors → ids [b, L] and attention mask [b, L], padded on the right."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return ids, mask


def pass_groups(lengths: list[int], budget: int = PASS_TOKENS) -> list[list[int]]:
    """Runs of consecutive sequences whose right-padded forward stays within `budget` positions (one at least)."""
    groups: list[list[int]] = []
    top = 0
    for k, n in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * max(top, n) <= budget:
            groups[-1].append(k)
            top = max(top, n)
        else:
            groups.append([k])
            top = n
    return groups


@torch.inference_mode()
def sequence_features(model, seqs: list[torch.Tensor], layer_ids: list[int]) -> list[torch.Tensor]:
    """Selected-layer hidden states per position, one [n_i, len(layer_ids) * hidden] tensor per sequence."""
    return [f for f, _ in target_passes(model, seqs, layer_ids, 0)]


@torch.inference_mode()
def target_passes(model, seqs: list[torch.Tensor], layer_ids: list[int] | None, topk: int):
    """Teacher-forced forwards over whole sequences: (features [n_i, F] or None, (top-k ids, log-probs) [n_i, K] or
    None) per sequence, in order. Top-k row t is the distribution that predicted token t (row 0 is zero)."""
    dev = next(model.parameters()).device
    # every position's logits are kept for top-k ([b, L, vocab]): smaller groups
    budget = PASS_TOKENS // 4 if topk else PASS_TOKENS
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    res: list = [None] * len(seqs)
    for group in pass_groups([len(seqs[i]) for i in order], budget):
        idx = [order[k] for k in group]
        ids, mask = right_pad([seqs[i] for i in idx])
        out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=bool(layer_ids),
                    logits_to_keep=0 if topk else 1)
        feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1) if layer_ids else None  # [b, L, F]
        for j, i in enumerate(idx):
            n = len(seqs[i])
            f = feats[j, :n].to(torch.bfloat16).cpu() if feats is not None else None
            tk = None
            if topk:
                vals, top = torch.log_softmax(out.logits[j, : n - 1].float(), -1).topk(topk, -1)
                tk = (torch.cat([top.new_zeros(1, topk), top]).to(torch.int32).cpu(),
                      torch.cat([vals.new_zeros(1, topk), vals.clamp_min(-60)]).to(torch.float16).cpu())
            res[i] = (f, tk)
    return res


def answer_prompts(model, enc: list[list[int]], order: list[int], *, rows: int, max_new_tokens: int,
                   temperature: float, stop_ids: list[int], seed: int, layer_ids: list[int] | None,
                   topk: int, prefix_cache_mib: float = PREFIX_CACHE_MIB) -> Iterator[tuple[int, Sequence]]:
    """(prompt index, its Sequence) as answers finish: the target's own plain decoding through the batched decoder
    (at most `rows` in flight, prompts taken in `order`; a prompt extending a recent one prefills only the rest, bit
    for bit the same); features and top-k, when asked for, from one teacher-forced forward per `rows` finished answers."""
    stops = tuple(stop_ids)
    # each prompt its own sampler seed, so its answer does not depend on which prompts share its batch
    settings = [DecodeSettings(block_size=1, lookup=False, max_new_tokens=max_new_tokens, temperature=temperature,
                               seed=seed * 1_000_003 + k, stop_token_ids=stops) for k in order]
    done: list[tuple[int, Sequence]] = []
    for i, r in decode_stream(model, None, [enc[k] for k in order], settings, adaptive=False, max_batch=rows,
                              prefix_cache_mib=prefix_cache_mib):
        k = order[i]
        ids = torch.tensor(enc[k] + r.output_ids, dtype=torch.long)
        mask = torch.arange(len(ids)) >= len(enc[k])
        done.append((k, Sequence(ids, mask, finished=bool(r.output_ids) and r.output_ids[-1] in stops)))
        if not (layer_ids or topk):
            yield done.pop()
        elif len(done) == rows:
            yield from with_passes(model, done, layer_ids, topk)
            done = []
    if done:
        yield from with_passes(model, done, layer_ids, topk)


def with_passes(model, answers: list[tuple[int, Sequence]], layer_ids: list[int] | None,
                topk: int) -> list[tuple[int, Sequence]]:
    """The answers with their features and top-k rows (zero on the prompt) filled in."""
    for (_, s), (f, tk) in zip(answers, target_passes(model, [s.input_ids for _, s in answers], layer_ids, topk)):
        s.features = f
        if tk is not None:
            s.topk_ids, s.topk_logprobs = (t.masked_fill(~s.loss_mask[:, None], 0) for t in tk)
    return answers


# ---------------------------------------------------------------- shards

def shard_dir(out: Path, i: int) -> Path:
    return out / f"shard_{i:05d}"


def prompts_hash(prompts: list[Conversation]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


def shard_done(path: Path, prompts: list[Conversation]) -> bool:
    """A finished shard made from exactly these prompts (older shards without a hash: same count)."""
    file = path / "tokens.safetensors"
    if not file.is_file():
        return False
    try:
        with safe_open(str(file), "pt") as f:
            stored = (f.metadata() or {}).get("prompts_sha256")
            count = f.get_slice("offsets").get_shape()[0] - 1
    except (SafetensorError, OSError):
        return False
    return stored == prompts_hash(prompts) if stored else count == len(prompts)


def write_shard(path: Path, seqs: list[Sequence], prompts: list[Conversation] | None = None) -> None:
    """Write one shard directory atomically (tokens, and features when every sequence has them)."""
    lens = torch.tensor([0] + [len(s.input_ids) for s in seqs], dtype=torch.int64)
    tokens = {"input_ids": torch.cat([s.input_ids for s in seqs]).to(torch.int32),
              "loss_mask": torch.cat([s.loss_mask for s in seqs]).to(torch.uint8),
              "offsets": lens.cumsum(0), "finished": torch.tensor([s.finished for s in seqs], dtype=torch.uint8)}
    with atomic_dir(path) as tmp:
        if all(s.features is not None for s in seqs):
            save_file({"features": torch.cat([s.features for s in seqs]).contiguous()}, str(tmp / "features.safetensors"))
        if all(s.topk_ids is not None for s in seqs):
            save_file({"ids": torch.cat([s.topk_ids for s in seqs]).contiguous(),
                       "logprobs": torch.cat([s.topk_logprobs for s in seqs]).contiguous()}, str(tmp / "topk.safetensors"))
        meta = {"format": DATA_FORMAT, **({"prompts_sha256": prompts_hash(prompts)} if prompts is not None else {})}
        save_file(tokens, str(tmp / "tokens.safetensors"), metadata=meta)


def read_shard(path: Path, features: bool = False, topk: bool = False) -> list[Sequence]:
    """Sequences of one shard directory (features and top-k only when asked for)."""
    try:
        tok = load_file(str(path / "tokens.safetensors"))
        feats = load_file(str(path / "features.safetensors"))["features"] if features else None
        tk = load_file(str(path / "topk.safetensors")) if topk else None
    except FileNotFoundError as e:
        name = Path(e.filename or "").name or "file"
        fix = {"features.safetensors": "re-run prepare with --features", "topk.safetensors": "re-run prepare with --topk"}
        raise FlashdraftError(f"{path}: missing {name}; {fix.get(name, 're-run flashdraft prepare')}") from None
    except (SafetensorError, OSError, KeyError) as e:
        raise FlashdraftError(f"{path}: unreadable shard ({e}); delete it and re-run flashdraft prepare") from None
    off, fin = tok["offsets"].tolist(), tok["finished"].tolist()
    return [Sequence(tok["input_ids"][a:b].long(), tok["loss_mask"][a:b].bool(),
                     feats[a:b] if feats is not None else None, bool(f),
                     tk["ids"][a:b] if tk else None, tk["logprobs"][a:b] if tk else None)
            for a, b, f in zip(off[:-1], off[1:], fin)]


def read_meta(data_dir: str | Path) -> dict:
    """meta.json of a prepared data directory."""
    file = Path(data_dir) / "meta.json"
    if not file.is_file():
        raise FlashdraftError(f"{data_dir} is not a prepared data directory (no meta.json); run flashdraft prepare first")
    try:
        meta = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise FlashdraftError(f"{file} is not valid JSON ({e.msg}); re-run flashdraft prepare") from None
    if meta.get("format") != DATA_FORMAT:
        raise FlashdraftError(f"{file}: format {meta.get('format')!r} is not {DATA_FORMAT!r}")
    return meta


def load_sequences(data_dir: str | Path, features: bool = False, topk: bool = False) -> list[Sequence]:
    """Every finished shard's sequences, in shard order."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    if features and not meta.get("feature_layer_ids"):
        raise FlashdraftError(f"{data_dir} has no stored features; re-run prepare with --features or train online")
    if topk and not meta.get("topk"):
        raise FlashdraftError(f"{data_dir} has no stored top-k distributions; re-run prepare with --topk K")
    n_shards = math.ceil(meta["num_prompts"] / meta["shard_size"])  # shards past it are from a larger earlier run
    shards = [shard_dir(data_dir, i) for i in range(n_shards) if (shard_dir(data_dir, i) / "tokens.safetensors").is_file()]
    seqs = [s for p in shards for s in read_shard(p, features, topk)]
    if not seqs:
        raise FlashdraftError(f"{data_dir} holds no finished shards yet; wait for flashdraft prepare or re-run it")
    return seqs


def data_dirs(data: str | list[str]) -> list[str]:
    """--data as a list: one prepared directory (a string, as older runs stored it) or several."""
    return [data] if isinstance(data, str) else list(data)


def check_alike(dirs: list[str], features: bool = False) -> None:
    """Prepared directories trained on together must come from the same target (and feature layers)."""
    metas = [read_meta(d) for d in dirs]
    for d, m in zip(dirs[1:], metas[1:]):
        for key in ("target", "feature_layer_ids") if features else ("target",):
            if m.get(key) != metas[0].get(key):
                raise FlashdraftError(f"--data {d} has {key} {m.get(key)!r} but {dirs[0]} has {metas[0].get(key)!r}; "
                                      "train on directories prepared alike")


def load_all(data: str | list[str], features: bool = False, topk: bool = False) -> list[Sequence]:
    """load_sequences over several prepared directories, in order; they must come from the same target and layers."""
    dirs = data_dirs(data)
    check_alike(dirs, features)
    return [s for d in dirs for s in load_sequences(d, features, topk)]


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


def prepare(target, prompts: list[Conversation], out_dir: str | Path, *, max_new_tokens: int = 256,
            temperature: float = 0.0, batch_size: int = 16, shard_size: int = 256, seed: int = 0,
            feature_layer_ids: list[int] | None = None, chat: bool = True, sources: list[str] | None = None,
            progress: bool = True, topk: int = 0, part: tuple[int, int] = (0, 1), dev: list[str] | None = None,
            prefix_cache_mib: float = PREFIX_CACHE_MIB) -> dict:
    """Generate target responses for prompts into sharded token files under out_dir; returns a summary dict.

    batch_size is the number of prompts in flight (the batched decoder: a finished row takes the next prompt at once).
    part=(i, n) makes only shards with index % n == i, so n processes can share one output directory.
    dev: held-out prompts written to OUT/dev.jsonl (see split_dev).
    """
    if not prompts:
        raise FlashdraftError("no prompts to generate from; pass --prompts FILE.jsonl or --dataset NAME")
    check_prepare_settings(max_new_tokens, batch_size, shard_size, temperature, topk)
    model = target.model
    check_feature_layer_ids(model, feature_layer_ids)
    out = Path(out_dir)
    meta = {"format": DATA_FORMAT, "target": target.name, "num_prompts": len(prompts), "shard_size": shard_size,
            "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed, "chat": chat,
            "feature_layer_ids": feature_layer_ids, "topk": topk, "sources": sources or [],
            "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}
    open_data_dir(out, meta)
    if dev:
        write_dev(out, dev)
    n_shards = math.ceil(len(prompts) / shard_size)
    chunks = {i: prompts[i * shard_size:(i + 1) * shard_size] for i in range(n_shards) if i % part[1] == part[0]}
    todo = [i for i, chunk in chunks.items() if not shard_done(shard_dir(out, i), chunk)]
    if feature_layer_ids:  # finished shards made without features (not other parts' shards still to come)
        done = [i for i in range(n_shards) if i not in todo and (shard_dir(out, i) / "tokens.safetensors").is_file()]
        add_features(model, out, done, prompts, shard_size, feature_layer_ids, progress)
    t0 = time.perf_counter()
    new_tokens = fill_shards(target, out, chunks, todo, shard_size=shard_size, rows=batch_size,
                             max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, chat=chat,
                             layer_ids=feature_layer_ids, topk=topk, progress=progress,
                             prefix_cache_mib=prefix_cache_mib)
    return data_stats(out, time.perf_counter() - t0, new_tokens)


def check_prepare_settings(max_new_tokens: int, batch_size: int, shard_size: int, temperature: float,
                           topk: int) -> None:
    """One-line errors for prepare settings that cannot work (NaN included)."""
    if max_new_tokens < 1:
        raise FlashdraftError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1 or shard_size < 1:
        raise FlashdraftError(f"--batch-size and --shard-size must be >= 1, got {batch_size} and {shard_size}")
    if not 0 <= temperature < math.inf:
        raise FlashdraftError(f"--temperature must be a finite number >= 0, got {temperature}")
    if topk < 0:
        raise FlashdraftError(f"--topk must be >= 0, got {topk}")


def check_feature_layer_ids(model, feature_layer_ids: list[int] | None) -> None:
    """Feature layers must exist in the target."""
    n_layers = model.config.get_text_config().num_hidden_layers
    bad = [i for i in feature_layer_ids or [] if not 0 <= i < n_layers]
    if bad:
        raise FlashdraftError(f"feature layer ids {bad} are outside the target's layers 0..{n_layers - 1}")


def open_data_dir(out: Path, meta: dict) -> None:
    """Start OUT, or continue it when it was prepared with the same settings; (re)writes meta.json."""
    if (out / "meta.json").is_file():
        old = read_meta(out)
        defaults = {"topk": 0}  # sets prepared before a setting existed had its default
        diff = [k for k in meta if k not in ("sources", "dtype", "num_prompts")
                and old.get(k, defaults.get(k)) != meta[k]]
        if diff == ["feature_layer_ids"] and old.get("feature_layer_ids") is None:
            diff = []  # --features on a set prepared without: add features to the finished shards below
        if diff:
            raise FlashdraftError(f"{out} was prepared with different settings "
                                  f"({', '.join(f'{k}={old.get(k)!r}' for k in diff)}); "
                                  "use a new output directory or the same settings to resume")
    elif out.exists() and any(out.iterdir()):
        raise FlashdraftError(f"{out} exists and is not a prepared data directory; choose an empty or new directory")
    write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n")


def check_context(model, enc: list[list[int]], index: list[int], max_new_tokens: int) -> None:
    """Every prompt and its longest answer must fit the target's context (beyond it positions mean nothing)."""
    limit = T.context_limit(model)
    for ids, k in zip(enc, index):
        if len(ids) + max_new_tokens > limit:
            raise FlashdraftError(f"prompt {k} has {len(ids)} tokens: with --max-new-tokens {max_new_tokens} it does "
                                  f"not fit the target's context of {limit} tokens; shorten or drop it, or lower "
                                  "--max-new-tokens")


def fill_shards(target, out: Path, chunks: dict[int, list[Conversation]], todo: list[int], *, shard_size: int,
                rows: int, max_new_tokens: int, temperature: float, seed: int, chat: bool,
                layer_ids: list[int] | None, topk: int, progress: bool, prefix_cache_mib: float) -> int:
    """Answer the prompts of the shards in `todo` and write each shard as it completes; returns new tokens."""
    from tqdm import tqdm

    enc = [[encode_prompt(target, p, chat) for p in chunks[i]] for i in todo]
    check_context(target.model, [e for c in enc for e in c],
                  [i * shard_size + j for i in todo for j in range(len(chunks[i]))], max_new_tokens)
    mine = sum(map(len, chunks.values()))
    bar = tqdm(total=mine, initial=mine - sum(map(len, enc)), unit="seq", disable=not progress, dynamic_ncols=True,
               desc="prepare", smoothing=0.05)
    new_tokens = 0
    for k, seqs in answer_chunks(target, enc, rows=rows, max_new_tokens=max_new_tokens,
                                 temperature=temperature, seed=seed, layer_ids=layer_ids, topk=topk, bar=bar,
                                 prefix_cache_mib=prefix_cache_mib):
        write_shard(shard_dir(out, todo[k]), seqs, chunks[todo[k]])
        new_tokens += sum(int(s.loss_mask.sum()) for s in seqs)
    bar.close()
    return new_tokens


def answer_chunks(target, enc: list[list[list[int]]], *, rows: int, max_new_tokens: int,
                  temperature: float, seed: int, layer_ids: list[int] | None, topk: int,
                  bar, prefix_cache_mib: float = PREFIX_CACHE_MIB) -> Iterator[tuple[int, list[Sequence]]]:
    """(chunk position, its sequences) as each chunk of encoded prompts is answered; one stream over all chunks."""
    # One stream over every chunk, each chunk's prompts shortest first: rows of the next chunk start while the last
    # long answers of the previous one finish, so the batch never drains between shards.
    flat = [e for c in enc for e in c]
    where = [(i, j) for i, c in enumerate(enc) for j in range(len(c))]
    order = sorted(range(len(flat)), key=lambda k: (where[k][0], len(flat[k])))
    seqs: dict[int, list[Sequence | None]] = {i: [None] * len(c) for i, c in enumerate(enc)}
    left = {i: len(c) for i, c in enumerate(enc)}
    new_tokens, done, t0 = 0, 0, time.perf_counter()
    for k, seq in answer_prompts(target.model, flat, order, rows=rows, max_new_tokens=max_new_tokens,
                                 temperature=temperature, stop_ids=target.stop_token_ids(), seed=seed,
                                 layer_ids=layer_ids, topk=topk, prefix_cache_mib=prefix_cache_mib):
        i, j = where[k]
        seqs[i][j] = seq
        left[i] -= 1
        new_tokens += int(seq.loss_mask.sum())
        bar.update(1)
        bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - t0):.0f} tok/s, "
                            f"{done + (not left[i])}/{len(enc)} shards of this run")
        if not left[i]:
            done += 1
            yield i, seqs.pop(i)  # type: ignore[misc]


def add_features(model, out: Path, shards: list[int], prompts: list[Conversation], shard_size: int,
                 layer_ids: list[int], progress: bool = True) -> None:
    """Compute and store features for finished shards that lack them, from their stored tokens (no regeneration)."""
    from tqdm import tqdm

    missing = [i for i in shards if not (shard_dir(out, i) / "features.safetensors").is_file()]
    if not missing:
        return
    bar = tqdm(total=len(missing), unit="shard", disable=not progress, dynamic_ncols=True, desc="features")
    for i in missing:
        seqs = read_shard(shard_dir(out, i))
        for s, f in zip(seqs, sequence_features(model, [s.input_ids for s in seqs], layer_ids)):  # grouped by length
            s.features = f
        write_shard(shard_dir(out, i), seqs, prompts[i * shard_size:(i + 1) * shard_size])
        bar.update(1)
    bar.close()


def data_stats(out: Path, seconds: float = 0.0, new_tokens: int = 0) -> dict:
    """Counts over every finished shard of a data directory."""
    seqs = load_sequences(out)
    n_tok = sum(len(s.input_ids) for s in seqs)
    n_resp = sum(int(s.loss_mask.sum()) for s in seqs)
    return {"sequences": len(seqs), "unfinished": sum(not s.finished for s in seqs), "tokens": n_tok,
            "response_tokens": n_resp, "disk_bytes": dir_size(out),
            "seconds": seconds, "generated_tokens_this_run": new_tokens,
            "tokens_per_s": new_tokens / seconds if seconds > 0 else 0.0}
