"""Load and save drafters in the z-lab / official safetensors layout, and check them against a target."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .atomic import atomic_dir
from .config import DrafterConfig, config_to_dict, load_config
from .drafter import DFlashDrafter
from .dtypes import DTYPE_NAMES, dtype_name
from .errors import FlashdraftError

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16' / 'torch.bfloat16' / torch.bfloat16 → torch.bfloat16."""
    if isinstance(name, torch.dtype):
        return name
    return DTYPES[dtype_name(name)]


def build_drafter(config: DrafterConfig) -> torch.nn.Module:
    """Instantiate the module for config.arch with randomly initialised weights."""
    if config.arch in ("dflash", "dflash2"):
        return DFlashDrafter(config)
    raise FlashdraftError(f"drafter architecture {config.arch!r} is not supported by this version of flashdraft")


# The official save_pretrained writes the selector codebooks as nn.Embedding weights; released checkpoints, vLLM and
# SGLang use the bare names, which are what save_drafter writes.
CODEBOOK_ALIASES = {f"candidate_selector.{side}_codebook.weight": f"candidate_selector.{side}_codebook"
                    for side in ("predecessor", "successor")}


def canonical_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors with `.weight`-suffixed codebooks under their bare names."""
    out = dict(state)
    for alias, name in CODEBOOK_ALIASES.items():
        if alias in out and name not in out:  # a file with both spellings keeps the alias: "unexpected weights"
            out[name] = out.pop(alias)
    return out


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors from every *.safetensors file in a directory."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FlashdraftError(f"{path}: no *.safetensors weights found")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise FlashdraftError(f"{f}: unreadable safetensors file ({e}); re-download or re-export it") from None
    return canonical_names({k.removeprefix("model."): v for k, v in state.items()})


def load_drafter(path: str | Path, dtype: str | torch.dtype | None = None, device: str = "cpu") -> torch.nn.Module:
    """Load a drafter directory (config.json + safetensors); dtype defaults to the file's torch_dtype."""
    path = Path(path)
    if not path.is_dir():
        raise FlashdraftError(f"drafter {path} is not a directory; pass a folder with config.json and *.safetensors")
    config = load_config(path)
    state = read_weights(path)
    model = build_drafter(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise FlashdraftError(f"{path}: missing weights {missing[:4]}{' …' if len(missing) > 4 else ''} ({len(missing)} total)")
    if unexpected:
        raise FlashdraftError(f"{path}: unexpected weights {unexpected[:4]}{' …' if len(unexpected) > 4 else ''} "
                              f"({len(unexpected)} total); is config.json the one for these weights?")
    fc_in = state["fc.weight"].shape[-1]
    if fc_in != len(config.target_layer_ids) * config.target_hidden_size:
        raise FlashdraftError(f"{path}: fc takes {fc_in} features but len(target_layer_ids) * target hidden size = "
                              f"{len(config.target_layer_ids)} * {config.target_hidden_size}; config.json and weights disagree")
    for name, tensor in expected.items():
        if state[name].shape != tensor.shape:
            raise FlashdraftError(f"{path}: weight {name} has shape {tuple(state[name].shape)}, "
                                  f"config.json implies {tuple(tensor.shape)}")
    model.load_state_dict(state)
    model.draft_vocab = read_draft_vocab(path, config.vocab_size)
    return model.to(device=device, dtype=parse_dtype(dtype or config.torch_dtype)).eval()


DRAFT_VOCAB = "draft_vocab.json"  # optional; engines that don't know it ignore it (it is not a weights file)


def read_draft_vocab(path: Path, vocab_size: int) -> torch.Tensor | None:
    """The sorted token ids a drafter may propose, from DIR/draft_vocab.json {"ids": [...]}; None when absent."""
    file = path / DRAFT_VOCAB
    if not file.is_file():
        return None
    try:
        ids = json.loads(file.read_text())["ids"]
        ok = isinstance(ids, list) and ids and all(isinstance(i, int) and 0 <= i < vocab_size for i in ids)
    except (json.JSONDecodeError, KeyError, TypeError):
        ok = False
    if not ok:
        raise FlashdraftError(f"{file}: expected {{\"ids\": [token ids in 0..{vocab_size - 1}]}}; fix or delete it "
                              "(without it the drafter proposes from the whole vocabulary)")
    return torch.tensor(sorted(set(ids)), dtype=torch.long)


def draft_vocab_json(ids: torch.Tensor) -> str:
    return json.dumps({"ids": [int(i) for i in ids]}) + "\n"


def save_drafter(model: torch.nn.Module, path: str | Path, dtype: str | torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors atomically in the official layout (no `model.` prefix)."""
    config: DrafterConfig = model.config
    dtype = parse_dtype(dtype or next(model.parameters()).dtype)
    config.torch_dtype = str(dtype).replace("torch.", "")
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    with atomic_dir(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(config_to_dict(config), indent=2) + "\n")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if getattr(model, "draft_vocab", None) is not None:
            (tmp / DRAFT_VOCAB).write_text(draft_vocab_json(model.draft_vocab))


def check_compatible(config: DrafterConfig, num_layers: int, hidden_size: int, vocab_size: int, where: str) -> None:
    """One-line errors for a drafter that cannot run on this target."""
    bad = [i for i in config.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise FlashdraftError(f"{where}: target_layer_ids {bad} are outside the target's layers 0..{num_layers - 1}; "
                              "this drafter was made for a different target")
    if config.hidden_size != hidden_size:
        raise FlashdraftError(f"{where}: drafter hidden_size {config.hidden_size} != target hidden size {hidden_size}; "
                              "this drafter was made for a different target")
    if config.vocab_size != vocab_size:
        raise FlashdraftError(f"{where}: drafter vocab_size {config.vocab_size} != target vocabulary {vocab_size}; "
                              "this drafter was made for a different target")
    if not 0 <= config.mask_token_id < vocab_size:
        raise FlashdraftError(f"{where}: mask_token_id {config.mask_token_id} is outside the target vocabulary 0..{vocab_size - 1}")
