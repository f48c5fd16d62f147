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


def legend_outside(ax, below: bool = False, **kwargs) -> None:
    """The axes' legend to the right of the data (below it: for panels side by side), where it hides no curve."""
    where = dict(loc="upper center", bbox_to_anchor=(0.5, -0.2)) if below else dict(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**where, fontsize=7, frameon=False, **kwargs)


# ---- the report style: one colour per group, a line style per member --------------------------------
# Qualitative colours that stay apart on white (tab10 and two more): up to 12 groups without a repeat.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
           "#7f7f7f", "#000000", "#b8860b")
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D")


class SeriesStyle:
    """The look of every series of a report, fixed once for all its figures: each group (a mixer) one colour of
    PALETTE in first-seen order, each member of a group (an architecture with that mixer) its own line style and
    marker, so that a label looks the same in every figure. A label never added is its own group."""

    def __init__(self, members=()):
        self.groups: dict[str, int] = {}  # group -> its colour index
        self.styles: dict[str, dict] = {}
        for label, group in members:
            self.add(label, group)

    def add(self, label: str, group: str) -> None:
        if label in self.styles:
            return
        i = self.groups.setdefault(group, len(self.groups))
        k = sum(s["group"] == group for s in self.styles.values()) + i // len(PALETTE)  # past 12 groups: other dashes
        self.styles[label] = {"group": group, "color": PALETTE[i % len(PALETTE)],
                              "linestyle": LINE_STYLES[k % len(LINE_STYLES)], "marker": MARKERS[k % len(MARKERS)]}

    def group(self, group: str) -> dict:
        """matplotlib keywords of a group's own series (a mixer's line in a per-mixer plot): its colour, solid."""
        i = self.groups.setdefault(group, len(self.groups))
        return {"color": PALETTE[i % len(PALETTE)], "linestyle": "-", "marker": "o"}

    def __call__(self, label: str) -> dict:
        """matplotlib keywords (color, linestyle, marker) of the label's series."""
        self.add(label, label)
        return {k: v for k, v in self.styles[label].items() if k != "group"}


def mean_band(ax, points: list[list[tuple[float, float]]], label: str, style: dict, **kwargs) -> None:
    """One series: each point is the seeds' (x, y) there; the line joins the seeds' mean (x, y) in x order, a band
    spans their min-max y (a bar where the series has one point)."""
    import statistics

    rows = sorted((statistics.mean(x for x, _ in pts), statistics.mean(y for _, y in pts), min(y for _, y in pts),
                   max(y for _, y in pts)) for pts in points if pts)
    if not rows:
        return
    xs, ys, lo, hi = (list(c) for c in zip(*rows))
    ax.plot(xs, ys, label=label, **{"ms": 4, **style, **kwargs})
    if len(xs) > 1:
        ax.fill_between(xs, lo, hi, color=style["color"], alpha=0.15, linewidth=0)
    elif hi[0] > lo[0]:
        ax.vlines(xs, lo, hi, color=style["color"], alpha=0.5, linewidth=3)
