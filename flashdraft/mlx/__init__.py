"""DFlash on Apple's MLX: the target as an mlx-lm model, the drafter ported to MLX, and a decoding loop that shares
settings, acceptance rules and records with the torch engine (docs/design.md §5.4). Imported only with `--engine mlx`.
"""

from __future__ import annotations

from ..errors import FlashdraftError


def require_mlx() -> None:
    """A one-line error with the fix when MLX or mlx-lm is missing."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as e:
        raise FlashdraftError(f"the mlx engine needs MLX and mlx-lm ({e.name} is not installed): run `make mlx` "
                              "(pip install mlx mlx-lm on macOS, 'mlx[cpu]' mlx-lm on Linux)") from None
