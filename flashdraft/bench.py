"""`flashdraft bench`: ar / hf / hf-lookup / dflash / llamacpp / llamacpp-dflash on the same prompts and machine.

Drafter methods are swept over --drafter × --block-size × --loop-stages × --loop-gate (DLoop, dloop.py) × --lookup
(prompt lookup, lookup.py); llama.cpp
methods also over --gguf (target files). A method is one small function (target, prompt ids, Settings) → Sample,
registered in METHODS. Each method has a plain baseline on the same engine (ar, or llamacpp on the same target file)
that its speedup and its token-identity check refer to.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from .errors import FlashdraftError
from .jsonl import read_records
from .decoding import DEFAULT_TREE, DecodeSettings

HUB_DATASETS = {  # name → (hub id, config, split, record → turns)
    "gsm8k": ("openai/gsm8k", "main", "test", lambda r: [r["question"]]),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", lambda r: [r["problem"]]),
    "humaneval": ("openai/openai_humaneval", None, "test", lambda r: [r["prompt"]]),
    "mbpp": ("google-research-datasets/mbpp", "full", "test", lambda r: [r["text"]]),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", lambda r: list(r["prompt"])),
    "alpaca": ("tatsu-lab/alpaca", None, "train",
               lambda r: [r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "")]),
}
ALL_METHODS = "ar,hf,hf-lookup,dflash"  # the default; llamacpp methods need `make llamacpp`


@dataclass
class Settings:
    """What a method needs besides the target and the prompt."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    drafter: object | None = None  # a loaded drafter module
    block_size: int | None = None
    lookup_tokens: int = 10
    loop_stages: int = 1  # DLoop stages per cycle (1 = plain DFlash)
    loop_gate: float = -0.75
    lookup: bool | str = True  # prompt lookup where the context's last n-gram recurs; "tree": grafted onto the tree
    tree: int = 0  # draft-tree nodes per drafter cycle at T=0 (tree.py); 0 verifies the drafter's chain
    server: object | None = None  # a llamacpp.LlamaServer (llama.cpp methods only)


@dataclass
class Sample:
    """One generation: output, time to first token, total time, and per-cycle stats where the method has them."""

    output_ids: list[int]
    ttft_s: float
    total_s: float
    first_tokens: int = 1  # tokens that arrived with the first token (prefill); the rest count as decoding
    acceptance_lengths: list[int] = field(default_factory=list)
    draft_s: float | None = None  # None: the method has no per-cycle split
    verify_s: float | None = None
    other_s: float | None = None
    stages: list[int] = field(default_factory=list)  # drafting stages per cycle (drafter methods only)
    lookup_cycles: int = 0  # cycles drafted by prompt lookup instead of the drafter


Method = Callable[[object, list[int], Settings], Sample]


# ---------------------------------------------------------------- methods

def _flashdraft(target, ids: list[int], s: Settings, drafter, block_size: int) -> Sample:
    from .decoding import generate_ids

    r = generate_ids(target.model, drafter, ids, block_size=block_size, max_new_tokens=s.max_new_tokens,
                     temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                     stop_token_ids=s.stop_token_ids, loop_stages=s.loop_stages, loop_gate=s.loop_gate,
                     lookup=s.lookup, tree=s.tree)
    t = r.timing
    stages = [c.stages for c in r.cycles] if drafter is not None else []
    return Sample(r.output_ids, t.prefill_s, t.total_s, 1, r.acceptance_lengths, t.draft_s, t.verify_s, t.other_s,
                  stages, r.lookup_cycles)


def run_ar(target, ids: list[int], s: Settings) -> Sample:
    """flashdraft's own loop at block size 1 (the reference)."""
    return _flashdraft(target, ids, s, None, 1)


def run_dflash(target, ids: list[int], s: Settings) -> Sample:
    """DFlash speculative decoding with s.drafter (DFlash 1 or 2) at s.block_size, with DLoop when s.loop_stages > 1."""
    return _flashdraft(target, ids, s, s.drafter, s.block_size or s.drafter.config.block_size)


class _Clock:
    """A `generate` streamer that timestamps each chunk of new tokens (the first put is the prompt)."""

    def __init__(self):
        self.t0, self.prompt_seen, self.times, self.chunks = time.perf_counter(), False, [], []

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.chunks.append(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


def _hf(target, ids: list[int], s: Settings, **extra) -> Sample:
    """transformers `generate` (greedy, or sampling with the same settings), timed per chunk by a streamer."""
    import torch

    model = target.model
    clock = _Clock()
    stops = list(s.stop_token_ids)
    kw = dict(do_sample=not s.temperature == 0, max_new_tokens=s.max_new_tokens, min_new_tokens=0,
              eos_token_id=stops or None, pad_token_id=stops[0] if stops else 0, streamer=clock)
    if s.temperature > 0:
        kw.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
        torch.manual_seed(s.seed)
    x = torch.tensor([ids], device=model.device)
    clock.t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(x, attention_mask=torch.ones_like(x), **kw, **extra)
    total = time.perf_counter() - clock.t0
    out, chunks = [], []
    for chunk in clock.chunks:  # cut right after the first stop token, as flashdraft does
        cut = next((i + 1 for i, t in enumerate(chunk) if t in stops), None)
        out.extend(chunk[:cut])
        chunks.append(len(chunk[:cut]))
        if cut is not None:
            break
    ttft = clock.times[0] - clock.t0 if clock.times else total
    return Sample(out, ttft, total, chunks[0] if chunks else 0, chunks)


def run_hf(target, ids: list[int], s: Settings) -> Sample:
    """transformers `model.generate`."""
    return _hf(target, ids, s)


def run_hf_lookup(target, ids: list[int], s: Settings) -> Sample:
    """transformers prompt-lookup decoding (`prompt_lookup_num_tokens`)."""
    return _hf(target, ids, s, prompt_lookup_num_tokens=s.lookup_tokens)


def run_llamacpp(target, ids: list[int], s: Settings) -> Sample:
    """llama.cpp's llama-server, plain or with its built-in DFlash; times are the server's own (no HTTP)."""
    c = s.server.complete(ids, s.max_new_tokens, s.temperature, s.top_k, s.top_p, s.seed)
    ttft, gen = c.prompt_ms / 1000, c.predicted_ms / 1000
    if c.draft_ms is None:
        return Sample(c.tokens, ttft, ttft + gen)
    draft = c.draft_ms / 1000  # llama.cpp times drafting alone; the rest of a cycle counts as verify
    return Sample(c.tokens, ttft, ttft + gen, 1, c.acceptance_lengths, draft, max(0.0, gen - draft), 0.0)


METHODS: dict[str, Method] = {"ar": run_ar, "hf": run_hf, "hf-lookup": run_hf_lookup, "dflash": run_dflash,
                              "llamacpp": run_llamacpp, "llamacpp-dflash": run_llamacpp}
DRAFTER_METHODS = {"dflash", "llamacpp-dflash"}  # swept over --drafter × --block-size (× DLoop for dflash)
LLAMACPP_METHODS = {"llamacpp", "llamacpp-dflash"}  # swept over --gguf


# ---------------------------------------------------------------- datasets

@dataclass
class Prompt:
    id: str
    turns: list[str]


def load_jsonl(path: Path, label: str) -> list[Prompt]:
    """Records in the {"id": ..., "turns": [...]} shape."""
    prompts = []
    for where, rec in read_records(path):
        turns = rec.get("turns")
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
            raise FlashdraftError(f'{where}: expected {{"turns": ["non-empty prompt", ...]}}')
        prompts.append(Prompt(str(rec.get("id", f"{label}-{len(prompts)}")), turns))
    if not prompts:
        raise FlashdraftError(f"dataset {path} has no records")
    return prompts


def load_hub(name: str) -> list[Prompt]:
    """A known benchmark from the Hugging Face hub via `datasets` (imported only here)."""
    hub_id, config, split, to_turns = HUB_DATASETS[name]
    try:
        import datasets
        ds = datasets.load_dataset(hub_id, config, split=split)
    except ImportError:
        raise FlashdraftError(f"dataset {name!r} needs the `datasets` package (pip install datasets), "
                              "or pass a local JSONL path") from None
    except Exception as e:  # network / hub errors come in many types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise FlashdraftError(f"could not load dataset {name!r} ({hub_id}) from the Hugging Face hub: {first}; "
                              "pass a local JSONL path instead") from None
    return [Prompt(f"{name}-{i}", to_turns(r)) for i, r in enumerate(ds)]


def parse_dataset(arg: str) -> tuple[str, str]:
    """'NAME=PATH' → (NAME, PATH); 'PATH' → (file stem, PATH); 'gsm8k' → ('gsm8k', 'gsm8k')."""
    if "=" in arg and not Path(arg).exists():
        label, src = arg.split("=", 1)
        if not label or not src:
            raise FlashdraftError(f"--dataset {arg!r}: use NAME=PATH, a JSONL path or one of {sorted(HUB_DATASETS)}")
        return label, src
    return (Path(arg).stem if Path(arg).suffix else arg), arg


def load_dataset(label: str, src: str, max_samples: int | None, seed: int) -> list[Prompt]:
    """A local JSONL or a hub name, sub-sampled to max_samples with a fixed seed (dataset order kept)."""
    if Path(src).is_file():
        prompts = load_jsonl(Path(src), label)
    elif src in HUB_DATASETS:
        prompts = load_hub(src)
    else:
        raise FlashdraftError(f"--dataset {src!r} is neither a file nor one of {sorted(HUB_DATASETS)}")
    if max_samples is not None and len(prompts) > max_samples:
        keep = sorted(random.Random(seed).sample(range(len(prompts)), max_samples))
        prompts = [prompts[i] for i in keep]
    return prompts


def encode_turn(target, turns: list[str], answers: list[str], prev: list[int] | None, prev_out: list[int] | None,
                chat: bool) -> list[int]:
    """Prompt ids for turn len(answers): earlier turns are replayed with the model's own answers (MT-Bench style)."""
    k = len(answers)
    tok = target.tokenizer
    if k == 0:
        return target.encode(turns[0], chat=chat)
    if chat and getattr(tok, "chat_template", None):
        msgs = []
        for t, a in zip(turns[:k], answers):
            msgs += [{"role": "user", "content": t}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": turns[k]})
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return prev + prev_out + tok("\n\n" + turns[k], add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- results directory

def load_records(path: Path) -> list[dict]:
    """Finished samples; a torn last line (crash mid-append) is dropped and the file repaired."""
    if not path.is_file():
        return []
    text = path.read_text()
    records, good = [], []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
            good.append(line)
        except json.JSONDecodeError:
            continue
    if len(good) != len([ln for ln in text.splitlines() if ln.strip()]) or (text and not text.endswith("\n")):
        from .atomic import write_text
        write_text(path, "".join(ln + "\n" for ln in good))
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


def check_run(out: Path, config: dict, variants: dict[str, dict]) -> None:
    """Refuse to resume into a directory produced with different settings; record this run's settings."""
    from .atomic import write_text

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

@dataclass
class Variant:
    label: str
    method: str
    settings: Settings
    desc: dict


def loop_settings(stages: list[int], gates: list[float]) -> list[tuple[int, float]]:
    """(stages, gate) pairs to sweep: stages 1 is plain DFlash once (the gate never matters there)."""
    pairs = [(1, gates[0])] if 1 in stages else []
    return pairs + [(s, g) for s in dict.fromkeys(stages) if s > 1 for g in dict.fromkeys(gates)]


def variant_label(m: str, kind: str, parts: list[str]) -> str:
    """`dflash2[name,b8,s2,g-0.75]`, `llamacpp-dflash2[f32,name,b8]`: drafter methods are labelled by drafter kind."""
    head = {"dflash": kind, "llamacpp-dflash": f"llamacpp-{kind}"}.get(m, m)
    return f"{head}[{','.join(parts)}]" if parts else head


@dataclass
class Gguf:
    """A target file for the llama.cpp methods: a short label and its path."""

    label: str
    path: Path


def drafter_variants(target, m: str, drafters: list[str | None], block_sizes: list[int], base: Settings,
                     loops: list[tuple[int, float]], gguf: Gguf | None, threads: int | None,
                     servers: list, lookups: list[bool | str] = (True,),
                     trees: list[int | None] = (None,)) -> list[Variant]:
    """One Variant per (drafter, block size, loop setting, lookup, tree) of a drafter method; on llama.cpp per target
    file instead of per lookup and tree setting (llama.cpp drafts a chain every cycle)."""
    from .models import load_drafter_for, registered_drafter

    out = []
    for d in drafters:
        drafter = load_drafter_for(target, d)
        if drafter is None:
            raise FlashdraftError(f"method {m} needs a drafter and none is registered for {target.name}: "
                                  "pass --drafter DIR (or train one with `flashdraft train`)")
        kind, name = drafter.config.arch, Path(d).name if d else "registered"
        for b in block_sizes or [drafter.config.block_size]:
            if b < 2:
                raise FlashdraftError(f"--block-size {b}: {m} needs a block size >= 2 (block size 1 is `ar`)")
            desc = {"method": m, "drafter": str(Path(d).resolve()) if d else name, "kind": kind, "block_size": b}
            parts = [] if len(drafters) == 1 and len(block_sizes) <= 1 else [name, f"b{b}"]
            if gguf is not None:
                from .config import load_config
                from .llamacpp import LlamaServer, cached_export

                src = Path(d) if d else registered_drafter(target.name)
                trained = load_config(src).block_size
                if b > trained:
                    raise FlashdraftError(f"--block-size {b}: llama.cpp caps DFlash blocks at the drafter's trained "
                                          f"block size {trained}")
                path = cached_export("drafter", src, "f32", target.name)
                server = LlamaServer(gguf.path, path, b, threads, ctx_for(target))
                servers.append(server)
                desc |= {"gguf": str(gguf.path), "baseline": variant_label("llamacpp", "", [gguf.label])}
                out.append(Variant(variant_label(m, kind, [gguf.label] + parts), m,
                                   replace(base, block_size=b, server=server), desc))
                continue
            for (stages, gate), lookup, asked in itertools.product(loops, lookups, trees):
                tree = DecodeSettings(tree=asked, loop_stages=stages).resolve(None).tree
                label_parts, vdesc = list(parts), {**desc, "lookup": lookup, "tree": tree}
                if stages > 1:
                    label_parts += [f"s{stages}", f"g{gate:g}"]
                    vdesc |= {"loop_stages": stages, "loop_gate": gate}
                if len(lookups) > 1 or lookup is not True:  # on is the default and goes unlabelled alone
                    label_parts.append({True: "lookup", False: "no-lookup", "tree": "lookup-tree"}[lookup])
                if len(trees) > 1 or tree != DecodeSettings(loop_stages=stages).resolve(None).tree:  # the default goes unlabelled alone
                    label_parts.append(f"tree{tree}" if tree else "chain")
                settings = replace(base, drafter=drafter, block_size=b, loop_stages=stages, loop_gate=gate,
                                   lookup=lookup, tree=tree)
                out.append(Variant(variant_label(m, kind, label_parts), m, settings, vdesc))
    return out


def ctx_for(target) -> int:
    """llama-server's context: the target's, capped where its KV cache would only waste memory here."""
    from .target import context_limit

    return min(context_limit(target.model), 8192)


def build_variants(target, methods: list[str], drafters: list[str | None], block_sizes: list[int],
                   base: Settings, loop_stages: list[int] = (1,), loop_gates: list[float] = (-0.75,),
                   ggufs: list[Gguf] = (), threads: int | None = None,
                   servers: list | None = None, lookups: list[bool | str] = (True,),
                   trees: list[int | None] = (None,)) -> list[Variant]:
    """One Variant per method, per (drafter, block size, loop setting) for drafter methods and per --gguf file for
    llama.cpp methods; stable labels. llama.cpp servers are created (not started) and appended to `servers`."""
    servers = [] if servers is None else servers
    out = []
    loops = loop_settings(list(loop_stages), list(loop_gates))
    for m in methods:
        files = list(ggufs) if m in LLAMACPP_METHODS else [None]
        for g in files:
            if m in DRAFTER_METHODS:
                out += drafter_variants(target, m, drafters, block_sizes, base, loops, g, threads, servers, lookups,
                                        trees)
            elif g is not None:
                from .llamacpp import LlamaServer

                server = LlamaServer(g.path, threads=threads, ctx=ctx_for(target))
                servers.append(server)
                out.append(Variant(variant_label(m, "", [g.label]), m, replace(base, server=server),
                                   {"method": m, "gguf": str(g.path)}))
            else:
                out.append(Variant(m, m, base, {"method": m}))
    labels = [v.label for v in out]
    if len(set(labels)) != len(labels):
        raise FlashdraftError(f"two method variants share a label ({labels}); give drafters distinct folder names")
    return out


def turn_record(target, s: Sample, prompt_len: int) -> dict:
    """The per-turn part of a per-sample JSONL record."""
    return {"prompt_len": prompt_len, "output_ids": s.output_ids, "text": target.decode(s.output_ids),
            "new_tokens": len(s.output_ids), "first_tokens": s.first_tokens, "ttft_s": s.ttft_s,
            "total_s": s.total_s, "decode_s": max(0.0, s.total_s - s.ttft_s),
            "acceptance_lengths": s.acceptance_lengths, "stages": s.stages, "lookup_cycles": s.lookup_cycles,
            "cycle_timing": s.draft_s is not None, "draft_s": s.draft_s or 0.0, "verify_s": s.verify_s or 0.0,
            "other_s": s.other_s or 0.0}


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


def warm_up(target, variants: list[Variant], p: Prompt, chat: bool) -> None:
    """One short untimed generation per method so none pays first-call costs in the measurement."""
    ids = target.encode(p.turns[0], chat=chat)
    for v in variants:
        METHODS[v.method](target, ids, replace(v.settings, max_new_tokens=min(16, v.settings.max_new_tokens)))


def progress():
    """A rich progress bar on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True), transient=False)


limit_clock = time.monotonic  # what --limit-time is measured with (a seam for tests)


def run_bench(target, datasets: dict[str, list[Prompt]], variants: list[Variant], out: Path, chat: bool,
              limit_time: float | None) -> str | None:
    """Run every (dataset, prompt, method) not yet in samples.jsonl; returns why it stopped early, or None."""
    from rich.markup import escape

    path = out / "samples.jsonl"
    done = {(r["dataset"], r["id"], r["method"]) for r in load_records(path)}
    todo = [(ds, p, v) for ds, ps in datasets.items() for p in ps for v in variants if (ds, p.id, v.label) not in done]
    if not todo:
        return None
    t_start = limit_clock()
    warm_up(target, variants, todo[0][1], chat)
    bar = progress()
    plain = not bar.console.is_terminal
    stopped = None
    with bar:
        task = bar.add_task("bench", total=len(todo))
        for n, (ds, p, v) in enumerate(todo, 1):
            if limit_time is not None and limit_clock() - t_start >= limit_time:
                stopped = f"time limit of {limit_time:g}s reached after {n - 1} of {len(todo)} runs"
                break
            bar.update(task, description=escape(f"{ds} · {v.label} · {p.id}"))
            turns = run_sample(target, v, p, chat)
            append_record(path, {"dataset": ds, "id": p.id, "method": v.label, "turns": turns})
            bar.advance(task)
            if plain:
                toks = sum(t["new_tokens"] for t in turns)
                dec = sum(t["decode_s"] for t in turns)
                print(f"[{n}/{len(todo)}] {ds} {p.id} {v.label}: {toks} tokens, "
                      f"{sum(t['new_tokens'] - t['first_tokens'] for t in turns) / max(dec, 1e-9):.1f} tok/s",
                      file=sys.stderr, flush=True)
    return stopped


# ---------------------------------------------------------------- cost profile

PROFILE_BLOCKS = list(range(2, 17))


def measured_taus(records: list[dict], labels: list[str], variants: dict[str, Variant]) -> dict[int, float]:
    """τ by block size from the acceptance lengths of the largest block among labels, truncated to smaller blocks."""
    from .profile import truncated_tau

    runs = [lab for lab in labels if any(r["method"] == lab for r in records)]
    if not runs:
        return {}
    top = max(runs, key=lambda lab: variants[lab].settings.block_size)
    b_max = variants[top].settings.block_size
    hist: dict[int, int] = {}
    for r in records:
        if r["method"] == top:
            for t in r["turns"]:
                for a in t["acceptance_lengths"]:
                    hist[a] = hist.get(a, 0) + 1
    return {b: truncated_tau(hist, b) for b in PROFILE_BLOCKS if b <= b_max} if hist else {}


def run_profile(target, variants: list[Variant], datasets: dict[str, list[Prompt]], out: Path, chat: bool,
                threads: int | None, tokens: int = 128) -> dict:
    """The cost profile of each engine in the run (torch in its dtype, llama.cpp per target file) for each drafter,
    with break-even τ, and τ / best block size where this run measured the drafter; written to profile.json."""
    from .atomic import write_text
    from .config import load_config
    from .models import load_drafter_for
    from .profile import best_block, break_even, measure_torch, predict

    records = load_records(out / "samples.jsonl")
    by_label = {v.label: v for v in variants}
    drafters = list(dict.fromkeys(v.desc["drafter"] for v in variants if v.method in DRAFTER_METHODS)) or [None]
    torch_run = any(v.method not in LLAMACPP_METHODS for v in variants)
    files = list(dict.fromkeys(v.desc["gguf"] for v in variants if v.method in LLAMACPP_METHODS))
    ids = encode_turn(target, next(iter(datasets.values()))[0].turns, [], None, None, chat)
    dtype = str(next(target.model.parameters()).dtype).replace("torch.", "")
    rows = []
    with progress() as bar:
        task = bar.add_task("profile", total=len(drafters) * (int(torch_run) + len(files)))
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
                from .llamacpp import cached_export, measure_llamacpp
                from .models import registered_drafter

                bar.update(task, description=f"profile · llama.cpp {Path(f).name} · {name}")
                drafter_gguf, blocks = None, PROFILE_BLOCKS
                if d is not None:
                    src = registered_drafter(target.name) if d == "registered" else Path(d)
                    drafter_gguf = cached_export("drafter", src, "f32", target.name)
                    blocks = [b for b in PROFILE_BLOCKS if b <= load_config(src).block_size]
                prof = measure_llamacpp(Path(f), drafter_gguf, blocks, ids, threads, tokens, ctx_for(target))
                same = [v.label for v in mine if v.desc.get("gguf") == f]
                taus = measured_taus(records, same or [v.label for v in mine], by_label)
                rows.append({"label": f"llama.cpp {Path(f).name} · {name}", "drafter": d, **prof,
                             "tau_by_block": taus})
                bar.advance(task)
    for r in rows:
        r["break_even"] = break_even(r)
        r["predicted"] = predict(r, r["tau_by_block"]) if r["tau_by_block"] else {}
        r["best_block"] = best_block(r, r["tau_by_block"]) if r["tau_by_block"] else None
    profile = {"blocks": PROFILE_BLOCKS, "tokens": tokens, "profiles": rows}
    write_text(out / "profile.json", json.dumps(profile, indent=2) + "\n")
    return profile


# ---------------------------------------------------------------- CLI

def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmark ar / hf / hf-lookup / dflash on datasets",
                       description="Compare decoding methods on the same prompts, target, dtype and machine; "
                                   "check losslessness at temperature 0; write JSONL, JSON, Markdown and plots.")
    p.add_argument("--dataset", action="append", required=True,
                   help=f"JSONL path ({{\"turns\": [...]}} records), NAME=PATH, or one of {', '.join(HUB_DATASETS)} "
                        "(repeatable)")
    p.add_argument("--methods", default=ALL_METHODS,
                   help=f"comma-separated, from {', '.join(METHODS)} (default {ALL_METHODS}; ar is always run as the "
                        "reference, and llamacpp with llamacpp-dflash; the llamacpp methods need `make llamacpp`)")
    p.add_argument("--gguf", action="append",
                   help="target file for the llamacpp methods (repeatable): f32, f16, bf16 or q8_0 (the target "
                        "exported once with llama.cpp's converter, cached), packaged (the registered target's own "
                        "GGUF, e.g. Q4_1), or a GGUF path (default: f32)")
    p.add_argument("--profile", action="store_true",
                   help="after the run, measure each engine's plain step, verify(B) and draft(B) for B in 2..16 and "
                        "print the break-even τ and best block size (cost profile)")
    p.add_argument("--profile-tokens", type=int, default=128,
                   help="tokens each profile run generates from the first prompt (default 128)")
    p.add_argument("--target", help="registered name, local HF model dir or hub id (default: smollm2-135m-instruct)")
    p.add_argument("--drafter", action="append", help="drafter directory for dflash (repeatable; default: registered)")
    p.add_argument("--block-size", type=int, action="append", help="dflash block size (repeatable; default: drafter's)")
    p.add_argument("--loop-stages", default="1",
                   help="DLoop drafting stages per cycle to sweep for dflash, comma-separated "
                        "(default 1 = plain DFlash)")
    p.add_argument("--loop-gate", default="-0.75",
                   help="DLoop gates (summed draft log-probability needed for another stage) to sweep, "
                        "comma-separated, e.g. -0.5,-0.75,-1 (default -0.75; used when loop stages > 1)")
    p.add_argument("--lookup", default="on",
                   help="prompt lookup for dflash: on, off, tree, or a comma list to compare side by side (default on: "
                        "where the context's last n-gram recurs, verify what followed it instead of drafting; tree: "
                        "at temperature 0 verify it as one more path of the drafter's tree)")
    p.add_argument("--tree",
                   help="draft-tree nodes per drafter cycle at temperature 0, comma-separated to sweep, e.g. 0,7 "
                        f"(default {DEFAULT_TREE}, 0 with DLoop; 0 verifies the drafter's chain)")
    p.add_argument("--max-samples", type=int, help="prompts per dataset (a fixed-seed random subset)")
    p.add_argument("--subsample-seed", type=int, default=0, help="seed for --max-samples sub-sampling (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default; outputs must match ar)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens for hf-lookup (default 10)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int,
                   help="CPU threads for torch and llama.cpp (default: torch's choice; llama.cpp all cores)")
    p.add_argument("--no-chat", action="store_true", help="tokenize prompts as raw text, no chat template")
    p.add_argument("--no-ar", action="store_true",
                   help="skip the ar reference: no speedup vs ar and no token-identity check (for τ-only sweeps, "
                        "where ar would double the cost)")
    p.add_argument("--limit-time", type=float, help="stop starting new runs after SECONDS and report what finished")
    p.add_argument("--out", required=True, help="results directory (re-running with it resumes)")
    p.set_defaults(func=cmd_bench)


def parse_methods(text: str, reference: bool = True) -> list[str]:
    """--methods as a list, with ar (the reference) first unless --no-ar."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise FlashdraftError(f"--methods: unknown {bad or text!r}; choose from {', '.join(METHODS)}")
    methods = [m for m in dict.fromkeys(methods) if m != "ar"]
    if not reference and not methods:
        raise FlashdraftError("--no-ar leaves no method to run; add one to --methods")
    if reference and "llamacpp-dflash" in methods and "llamacpp" not in methods:  # its baseline
        methods.insert(methods.index("llamacpp-dflash"), "llamacpp")
    return (["ar"] if reference else []) + methods


def resolve_ggufs(specs: list[str] | None, target_name: str) -> list[Gguf]:
    """--gguf values → labelled target files: an outtype is exported once (cached), `packaged` is the registry's."""
    from .llamacpp import OUTTYPES, cached_export, local_target_dir
    from .models import REGISTRY, gguf_path

    out = []
    for spec in specs or ["f32"]:
        if spec in OUTTYPES:
            out.append(Gguf(spec, cached_export("target", local_target_dir(target_name), spec)))
        elif spec == "packaged":
            if target_name not in REGISTRY:
                raise FlashdraftError(f"--gguf packaged: {target_name} is not a registered target with a packaged "
                                      "GGUF; give a path or an outtype")
            path = gguf_path(REGISTRY[target_name])
            out.append(Gguf(path.stem.rsplit(".", 1)[-1], path))
        else:
            path = Path(spec)
            if not path.is_file():
                raise FlashdraftError(f"--gguf {spec}: no such file; give a GGUF path, packaged or one of "
                                      f"{', '.join(OUTTYPES)}")
            out.append(Gguf(path.stem.rsplit(".", 1)[-1], path))
    labels = [g.label for g in out]
    if len(set(labels)) != len(labels):
        raise FlashdraftError(f"--gguf files share the label {labels}; rename one")
    return out


def parse_list(text: str, what: str, kind: type) -> list:
    """'1,2,3' → [1, 2, 3]; a one-line error naming the option otherwise."""
    try:
        values = [kind(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise FlashdraftError(f"{what} must be comma-separated {kind.__name__} values, got {text!r}") from None
    if not values:
        raise FlashdraftError(f"{what} is empty; give comma-separated values such as 1,2,3")
    return values


LOOKUP_MODES: dict[str, bool | str] = {"on": True, "off": False, "tree": "tree"}


def parse_lookup(text: str) -> list[bool | str]:
    """--lookup 'on', 'off', 'tree' or a comma list of them → [True], [False], ['tree'], e.g. [True, 'tree']."""
    values = parse_list(text, "--lookup", str)
    if any(v not in LOOKUP_MODES for v in values):
        raise FlashdraftError(f"--lookup takes on, off, tree or a comma list of them (e.g. on,off); got {text!r}")
    return [LOOKUP_MODES[v] for v in dict.fromkeys(values)]


def parse_trees(text: str | None, loop_stages: list[int]) -> list[int | None]:
    """--tree '0,7' → [0, 7], checked (node counts >= 0; trees and DLoop do not combine); none given: [None], each
    variant's default (DEFAULT_TREE, the chain under DLoop)."""
    if text is None:
        return [None]
    trees = list(dict.fromkeys(parse_list(text, "--tree", int)))
    for t in trees:
        if t < 0:
            raise FlashdraftError(f"--tree takes node counts >= 0 (0 verifies the drafter's chain), got {t}")
    if any(trees) and max(loop_stages) > 1:
        raise FlashdraftError("--tree and --loop-stages > 1 do not combine; sweep them in separate runs")
    return trees


def parse_loops(args) -> tuple[list[int], list[float]]:
    """--loop-stages and --loop-gate as checked lists."""
    stages, gates = parse_list(args.loop_stages, "--loop-stages", int), parse_list(args.loop_gate, "--loop-gate", float)
    for s in stages:
        for g in gates:
            DecodeSettings(loop_stages=s, loop_gate=g).validate()
    return stages, gates


def check_bench_args(args) -> None:
    DecodeSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p).validate()
    if args.max_samples is not None and args.max_samples < 1:
        raise FlashdraftError(f"--max-samples must be >= 1, got {args.max_samples}")
    if args.limit_time is not None and not args.limit_time > 0:
        raise FlashdraftError(f"--limit-time must be > 0 seconds, got {args.limit_time}")
    if args.threads is not None and args.threads < 1:
        raise FlashdraftError(f"--threads must be >= 1, got {args.threads}")
    if args.profile_tokens < 2:
        raise FlashdraftError(f"--profile-tokens must be >= 2, got {args.profile_tokens}")
    if args.lookup_tokens < 1:
        raise FlashdraftError(f"--lookup-tokens must be >= 1, got {args.lookup_tokens}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise FlashdraftError(f"--out {out} exists and is not a directory")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_bench(args) -> int:
    import torch

    from . import report
    from .models import load_target
    from .packed import is_packed

    check_bench_args(args)
    methods = parse_methods(args.methods, reference=not args.no_ar)
    loop_stages, loop_gates = parse_loops(args)
    lookups = parse_lookup(args.lookup)
    trees = parse_trees(args.tree, loop_stages)
    labels = [parse_dataset(d) for d in args.dataset]
    if len({lab for lab, _ in labels}) != len(labels):
        raise FlashdraftError(f"two datasets share the label {[lab for lab, _ in labels]}; use NAME=PATH to name them")
    datasets = {lab: load_dataset(lab, src, args.max_samples, args.subsample_seed) for lab, src in labels}
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype, device=device)
    base = Settings(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed,
                    target.stop_token_ids(), lookup_tokens=args.lookup_tokens)
    uses_llamacpp = bool(LLAMACPP_METHODS & set(methods))
    if args.gguf and not uses_llamacpp:
        raise FlashdraftError("--gguf is for the llamacpp methods; add llamacpp or llamacpp-dflash to --methods")
    if uses_llamacpp:
        from .llamacpp import tool
        tool("llama-server")  # fail before any work when llama.cpp is not built
    ggufs = resolve_ggufs(args.gguf, target.name) if uses_llamacpp else []
    servers: list = []
    variants = build_variants(target, methods, args.drafter or [None], args.block_size or [], base, loop_stages,
                              loop_gates, ggufs, args.threads, servers, lookups, trees)
    config = {"target": target.name, "dtype": args.dtype, "device": device, "chat": not args.no_chat,
              "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "seed": args.seed, "lookup_tokens": args.lookup_tokens,
              "packed_linears": is_packed(target.model)}
    if uses_llamacpp:
        from .llamacpp import LLAMACPP_VERSION
        config["llamacpp"] = LLAMACPP_VERSION
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check_run(out, config, {v.label: v.desc for v in variants})
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    stopped, interrupted = None, False
    # Background jobs ignore SIGINT, so `kill` (SIGTERM) must also stop cleanly and leave a report.
    on_term = signal.signal(signal.SIGTERM, _interrupt)
    profile = None
    try:
        stopped = run_bench(target, datasets, variants, out, not args.no_chat, args.limit_time)
        if args.profile and not stopped:
            profile = run_profile(target, variants, datasets, out, not args.no_chat, args.threads, args.profile_tokens)
    except KeyboardInterrupt:
        stopped, interrupted = "interrupted", True
    finally:
        signal.signal(signal.SIGTERM, on_term)
        for server in servers:
            server.close()
    records = [r for r in load_records(out / "samples.jsonl")
               if r["dataset"] in datasets and r["method"] in {v.label for v in variants}
               and r["id"] in {p.id for p in datasets[r["dataset"]]}]
    if profile is None and args.profile and (out / "profile.json").is_file():
        profile = json.loads((out / "profile.json").read_text())  # a finished run resumed: its profile stands
    summary = report.summarize(records, [v.label for v in variants], config, datasets, stopped,
                               {v.label: v.desc for v in variants}, profile)
    report.write_all(out, summary)
    report.print_summary(summary, out)
    if interrupted:
        return 130
    return 1 if summary["correctness"]["failed"] else 0
