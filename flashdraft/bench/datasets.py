"""Bench prompts: local JSONL files or known hub benchmarks, sub-sampled, and multi-turn prompt encoding."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from ..errors import FlashdraftError
from ..jsonl import read_records

HUB_DATASETS = {  # name → (hub id, config, split, record → turns)
    "gsm8k": ("openai/gsm8k", "main", "test", lambda r: [r["question"]]),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", lambda r: [r["problem"]]),
    "humaneval": ("openai/openai_humaneval", None, "test", lambda r: [r["prompt"]]),
    "mbpp": ("google-research-datasets/mbpp", "full", "test", lambda r: [r["text"]]),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", lambda r: list(r["prompt"])),
    "alpaca": ("tatsu-lab/alpaca", None, "train",
               lambda r: [r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "")]),
}


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
