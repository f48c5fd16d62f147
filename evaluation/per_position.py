"""The loss by target position, as eval.py draws it for the val split and the length suite for each length: averaged
in log-spaced bins (one position's loss over a few sequences is mostly noise) and plotted on a log axis."""
from pathlib import Path

import numpy as np

from common.plots import legend_outside, pyplot, save_figure


def log_binned(losses: list[float], bins: int = 48) -> tuple[list[float], list[float]]:
    """The loss at target positions 1..n averaged within `bins` log-spaced bins of positions (over a few
    sequences one position's loss is mostly noise): (each bin's mean position, its mean loss)."""
    positions = np.arange(1, len(losses) + 1)
    edges = np.unique(np.rint(np.geomspace(1, len(losses) + 1, bins + 1)).astype(int))
    cuts = [(positions >= lo) & (positions < hi) for lo, hi in zip(edges[:-1], edges[1:])]
    return ([float(positions[c].mean()) for c in cuts if c.any()],
            [float(np.asarray(losses)[c].mean()) for c in cuts if c.any()])


def plot_loss_by_position(curves: dict[str, list[float]], train_seq_len: int | None, title: str, path: Path) -> Path:
    """Loss at each target position (log x, averaged in log-spaced bins: log_binned), one line per curve,
    a vertical line at the training length."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, losses in curves.items():
        ax.plot(*log_binned(losses), label=label, linewidth=1)
    if train_seq_len:
        ax.axvline(train_seq_len, color="gray", linestyle="--", linewidth=1, label="training length")
    ax.set_xscale("log")
    ax.set_xlabel("target position (tokens of context)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{title}: loss by position")
    ax.grid(alpha=0.3)
    legend_outside(ax)
    return save_figure(fig, path)
