"""Figures: matplotlib without a display (the Agg backend, chosen here once), saved one way, with the
legend outside the data. Every PNG the project writes goes through these."""
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed: CI, SSH, SLURM nodes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 120) -> Path:
    """Write `fig` to `path` (tight bounding box, so a legend outside the axes is kept) and close it."""
    plt = pyplot()
    path = Path(path)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def legend_outside(ax, **kwargs) -> None:
    """The axes' legend to the right of the data, where it hides no curve."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False, **kwargs)
