"""Apple's MLX: the target as an mlx-lm model from the same Hugging Face directory, the drafter ported to
MLX (flashdraft/mlx/). Metal on Apple silicon; MLX's CPU build elsewhere (correct, not fast: it links the
reference BLAS)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

from .. import target as T
from ..checkpoint import check_compatible, load_drafter
from ..decoding import DecodeSettings, GenerationResult
from ..decoding.settings import DEFAULTS
from ..errors import FlashdraftError
from ..mlx import require_mlx
from ..models import REGISTRY, registered_drafter, resolve_target
from . import check_chain_engine


class MlxEngine:
    """A target (and drafter) loaded into MLX in this process; the torch Target supplies tokenizer and stop ids."""

    name = "mlx"
    interleaves = True  # drafted and plain runs alternate in this process
    plain_name = "MLX plain decoding"

    def __init__(self, target, mlx_target, drafter, dtype: str):
        self.target, self.mlx_target, self.drafter, self.dtype = target, mlx_target, drafter, dtype

    @classmethod
    def check(cls, settings: DecodeSettings, lookup_flag: str | None = None) -> None:
        """One-line errors for a missing MLX and for what only the torch engine does (trees, DLoop)."""
        require_mlx()
        check_chain_engine(settings, lookup_flag, "MLX", lookup=True)

    @classmethod
    def open(cls, target, drafter: str | Path | None = None, settings: DecodeSettings | None = None, *,
             plain: bool = False) -> MlxEngine:
        """Load target's directory with mlx-lm (in the torch target's dtype) and drafter (a directory; None: the
        target's registered one) into MLX; plain: no drafter."""
        from ..mlx.drafter import from_torch
        from ..mlx.target import MLX_DTYPES, load_mlx_target

        settings = settings or DEFAULTS
        cls.check(settings)
        dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
        if dtype not in MLX_DTYPES:
            raise FlashdraftError(f"the mlx engine runs float32, bfloat16 or float16, not {dtype}; pass --dtype")
        src = None if plain or settings.block_size == 1 else drafter or registered_drafter(target.name)
        mx_drafter = None
        if src is not None:
            torch_drafter = load_drafter(src, dtype=torch.float32)
            check_compatible(torch_drafter.config, T.num_layers(target.model), T.hidden_size(target.model),
                             T.vocab_size(target.model), str(src))
            if drafter is None and REGISTRY[target.name].block_size:
                torch_drafter.config.block_size = REGISTRY[target.name].block_size
            mx_drafter = from_torch(torch_drafter, MLX_DTYPES[dtype])
        elif not plain and settings.block_size not in (None, 1):
            raise FlashdraftError(f"--block-size {settings.block_size} needs a drafter: pass --drafter DIR or use 1")
        elif not plain and settings.block_size is None:  # a plain run nobody asked for: say so
            print(f"flashdraft: no drafter registered for {target.name}; the mlx engine decodes plainly. Pass "
                  "--drafter DIR (a z-lab format drafter).", file=sys.stderr)
        mlx_target = load_mlx_target(str(resolve_target(target.name)), dtype)
        if mx_drafter is not None:
            mlx_target.capture(list(mx_drafter.config.target_layer_ids))
        return cls(target, mlx_target, mx_drafter, dtype)

    @classmethod
    def from_loaded(cls, target, mlx_target, drafter, dtype: str = "float32") -> MlxEngine:
        """An engine over an already loaded MlxTarget and MlxDrafter (tests, notebooks)."""
        return cls(target, mlx_target, drafter, dtype)

    @property
    def block_size(self) -> int | None:
        return self.drafter.config.block_size if self.drafter is not None else None

    def resolve(self, settings: DecodeSettings) -> DecodeSettings:
        """settings with the drafter's block size and the target's stop ids where they say None; a chain (tree 0)."""
        self.check(settings)
        return settings.resolve(self.block_size, self.target.stop_token_ids()).updated(tree=0)

    def generate(self, prompt_ids: list[int], settings: DecodeSettings,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        from ..mlx.decode import mlx_generate_ids

        T.check_prompt(self.target.model, prompt_ids)
        s = self.resolve(settings)
        drafter = self.drafter if s.block_size > 1 else None
        result = mlx_generate_ids(self.mlx_target, drafter, prompt_ids, s, T.vocab_size(self.target.model),
                                  T.context_limit(self.target.model), on_tokens)
        result.text = self.target.decode(result.output_ids)
        return result

    def describe(self, result: GenerationResult) -> str:
        c, t = result.config, result.timing
        looked = f" ({result.lookup_cycles} by prompt lookup)" if c["lookup"] else ""
        return (f"τ {result.tau:.2f} over {len(result.cycles)} cycles{looked}, {t.tokens_per_s:.1f} tok/s "
                f"(MLX, block {c['block_size']}, {self.dtype})")

    def close(self) -> None:
        pass  # nothing outside this process to stop

    def __enter__(self) -> MlxEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
