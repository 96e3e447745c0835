"""The dtype names flashdraft's flags, configs and files use, checked without loading torch (`flashdraft train
--help` builds its flags from TrainConfig, whose checks use them). checkpoint.DTYPES maps them to torch dtypes,
mlx.target.MLX_DTYPES to MLX's."""

from __future__ import annotations

from .errors import FlashdraftError

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def dtype_name(name) -> str:
    """'bfloat16' / 'torch.bfloat16' / torch.bfloat16 → 'bfloat16'; a one-line error for any other name."""
    key = str(name).replace("torch.", "")
    if key not in DTYPE_NAMES:
        raise FlashdraftError(f"unknown dtype {name!r}; use one of {sorted(DTYPE_NAMES)}")
    return key
