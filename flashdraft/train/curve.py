"""OUT/dev_tau.png: the run's dev τ against the response tokens trained on, redrawn after every dev evaluation."""
from __future__ import annotations

import os
from pathlib import Path


def dev_points(rows: list[dict]) -> tuple[list[float], list[float], str]:
    """(x, dev τ, x label) of the dev rows: millions of response tokens when every row counts them, else steps."""
    dev = [r for r in rows if "dev_tau" in r]
    if dev and all("response_tokens" in r for r in dev):
        return [r["response_tokens"] / 1e6 for r in dev], [r["dev_tau"] for r in dev], "response tokens trained on (M)"
    return [r["step"] for r in dev], [r["dev_tau"] for r in dev], "step"


def draw_dev_curve(rows: list[dict], png: Path) -> None:
    """Write the curve of `rows` to `png` atomically (nothing when there is no dev row)."""
    xs, ys, xlabel = dev_points(rows)
    if not xs:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(xs, ys, marker="o")
    best = max(range(len(ys)), key=ys.__getitem__)
    ax.annotate(f"best {ys[best]:.3f}", (xs[best], ys[best]), textcoords="offset points", xytext=(0, 6),
                ha="center", fontsize=8)
    ax.set(xlabel=xlabel, ylabel="dev τ", title="dev τ against training")
    ax.margins(y=0.15)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = png.with_name(f".{png.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, png)
