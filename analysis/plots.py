"""The report's figures, each through common.plots (one SeriesStyle per report: a mixer keeps its colour in every
figure, an architecture its line style): val metrics against tokens, wall-clock and training FLOPs with one series
per architecture over its budgets, throughput, MoE load, MQAR accuracy against state size and width, state-tracking accuracy against length, and
under --best-over the score against the swept key."""
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from analysis.best import ACCURACIES, BUDGET_KEYS, RUN_KEYS, Architecture, grouped, labels, numeric, value_text
from analysis.runs import Run, cfg_get
from analysis.summary import CURVE_AXES, curve
from common.plots import SeriesStyle, legend_outside, mean_band, pyplot, save_figure
from runs.plots import load_grid, load_layers, load_rows, state_accuracy_axes


@dataclass
class Series:
    """An architecture across budgets: at each budget the (run, summary) of each seed (under --best-over, its runs
    at that budget's best value)."""
    label: str
    mixer: str
    points: list[list[tuple[Run, dict]]]
    note: str = ""  # the legend's addition: the best value per budget and the seeds


def series_of(items: list[tuple[Run, dict]], key: str | None = None) -> list[Series]:
    """Runs grouped into architectures without their budget (and without `key`): one Series each, its points the
    budgets in first-seen order."""
    out = []
    groups = grouped(items, lambda run: [*RUN_KEYS, *BUDGET_KEYS, *([key] if key else [])])
    for label, (_, members) in zip(labels(groups), groups):
        budgets: dict[tuple, list] = {}
        for run, s in members:
            budgets.setdefault(s["budget"], []).append((run, s))
        seeds = sorted({len(p) for p in budgets.values()})
        values = "" if key is None else f"{key} " + ", ".join(dict.fromkeys(value_text(cfg_get(p[0][0].config, key))
                                                                            for p in budgets.values())) + "; "
        out.append(Series(label, str(members[0][1]["mixer"]), list(budgets.values()),
                          f" ({values}{'-'.join(map(str, seeds))} seed{'s' * (seeds != [1])})"))
    return out


def best_series(archs: list[Architecture], key: str) -> list[Series]:
    """Each architecture at its best value, the budgets of one architecture as one series."""
    return series_of([(r, s) for a in archs for r, s in zip(a.members[a.pick.value], a.runs[a.pick.value])], key)


def plot_curves(series: list[Series], out: Path, style: SeriesStyle) -> list[Path]:
    """val_loss_tokens.png, val_loss_time.png, val_bpb_flops.png, val_bpb_time.png: per architecture one series through
    its end points at each budget (mean over seeds, their min-max as a band), and thin, its val curve at each
    budget (the seeds' mean, evaluation by evaluation: seeds of one configuration evaluate at the same steps)."""
    plt = pyplot()
    bpb = "val/bpb" if all(s["val_bpb"] is not None for a in series for p in a.points for _, s in p) else "val/loss"
    written = []
    for name, x, metric in (("val_loss_tokens.png", "tokens", "val/loss"), ("val_loss_time.png", "time", "val/loss"),
                            ("val_bpb_flops.png", "flops", bpb), ("val_bpb_time.png", "time", bpb)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for a in series:
            ends = []
            for point in a.points:
                curves = [c for run, s in point if (c := curve(run, s, x, metric))]
                if curves:
                    ends.append([c[-1] for c in curves])
                    mean = [(statistics.mean(c[i][0] for c in curves), statistics.mean(c[i][1] for c in curves))
                            for i in range(min(map(len, curves)))]
                    ax.plot(*zip(*mean), color=style(a.label)["color"], linestyle=style(a.label)["linestyle"],
                            linewidth=0.8, alpha=0.4)
            mean_band(ax, ends, a.label + a.note, style(a.label))
        if not ax.lines:
            plt.close(fig)
            continue
        if x == "flops":
            ax.set_xscale("log")
        ax.set(xlabel=CURVE_AXES[x], ylabel="val bpb" if metric == "val/bpb" else "val loss (nats/token)")
        ax.set_title("markers: each budget's end (mean over seeds, band: min-max); thin: the val curve to it", fontsize=8)
        ax.grid(alpha=0.3)
        legend_outside(ax)
        written.append(save_figure(fig, out / name))
    return written


def plot_throughput(summaries: list[dict], out: Path, style: SeriesStyle) -> list[Path]:
    """throughput.png: training tokens/s per run (MFU in the label), coloured by mixer."""
    tput = [s for s in summaries if s["tokens_per_sec"]]
    if not tput:
        return []
    fig, ax = pyplot().subplots(figsize=(max(5, 0.7 * len(tput) + 2), 4))
    ax.bar(range(len(tput)), [s["tokens_per_sec"] for s in tput], color=[style.group(str(s["mixer"]))["color"] for s in tput])
    ax.set_xticks(range(len(tput)), [s["run"] + (f"\nMFU {100 * s['mfu']:.1f}%" if s["mfu"] else "") for s in tput],
                  rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("training tokens/s")
    return [save_figure(fig, out / "throughput.png")]


def plot_moe_load(runs: list[Run], summaries: list[dict], out: Path) -> list[Path]:
    """moe_load.png: per-expert share of routed tokens (layer x expert) at the last log, one panel per MoE run."""
    moe = [(s["run"], loads[-1]) for run, s in zip(runs, summaries) if (loads := load_rows(run.rows))]
    if not moe:
        return []
    fig, axes = pyplot().subplots(len(moe), 1, figsize=(7, 0.5 + 1.4 * len(moe)), squeeze=False)
    for ax, (name, row) in zip(axes[:, 0], moe):
        layers = load_layers([row])
        grid = load_grid(row, layers)
        im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0)
        ax.set_yticks(range(len(layers)), [f"layer {i}" for i in layers], fontsize=7)
        ax.set_title(f"{name} (step {row['step']}, uniform = {1 / grid.shape[1]:.3f})", fontsize=8)
        fig.colorbar(im, ax=ax)
    axes[-1, 0].set_xlabel("expert")
    return [save_figure(fig, out / "moe_load.png")]


def plot_mqar(points: list[dict], out: Path, style: SeriesStyle) -> list[Path]:
    """mqar_state.png, mqar_width.png: MQAR accuracy against decode-state size and against d_model, one line per
    mixer, as zoology plots them (points: summaries, or each architecture's at its best value)."""
    mqar = [s for s in points if s["mqar_acc"] is not None]
    written = []
    for xkey, name, xlabel in (("state_size", "mqar_state.png", "recurrent state size (numbers per sequence)"),
                               ("d_model", "mqar_width.png", "d_model")):
        if not mqar:
            break
        fig, ax = pyplot().subplots(figsize=(6.5, 4.5))
        for mixer in sorted({s["mixer"] for s in mqar}):
            pts = sorted((s[xkey], s["mqar_acc"]) for s in mqar if s["mixer"] == mixer and s[xkey])
            ax.plot(*zip(*pts), label=mixer, **style.group(mixer))
        style_mqar_axes(ax, xlabel)
        written.append(save_figure(fig, out / name))
    return written


def style_mqar_axes(ax, xlabel: str) -> None:
    """zoology's MQAR plot: accuracy in [0, 1] against a log2 axis (state size or width)."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MQAR accuracy (mean over slices)")
    ax.set_ylim(0, 1.02)
    legend_outside(ax)
    ax.grid(alpha=0.3)


def plot_state_accuracy(points: list[tuple[str, list[dict]]], out: Path, style: SeriesStyle) -> list[Path]:
    """state_acc_length.png: state-tracking accuracy against the length band L (prefix lengths (L/2, L]; log2 axis),
    one line per label through its seeds' mean, their min-max as a band (points: (label, the summaries of its
    seeds): each architecture at its best value, or each run), and each task's chance (1 / the group's order)."""
    def at_lengths(seeds):  # per band: [(L, each seed's accuracy)]
        bands = {k for s in seeds for k in s if k.startswith("state_acc/")}
        return [[(int(k.split("/")[1]), s[k]) for s in seeds if k in s] for k in bands]

    bands = [(label, at_length) for label, seeds in points if (at_length := at_lengths(seeds))]
    if not bands:
        return []
    fig, ax = pyplot().subplots(figsize=(6.5, 4.5))
    for label, at_length in bands:
        mean_band(ax, at_length, label, style(label))
    for chance in sorted({s["state_chance"] for _, seeds in points for s in seeds if s.get("state_chance")}):
        ax.axhline(chance, color="black", ls=":", lw=1, label=f"chance {chance:.3g}")
    lengths = sorted({x for _, at_length in bands for pts in at_length for x, _ in pts})
    state_accuracy_axes(ax, lengths, "length L (the band of prefix lengths (L/2, L]; training length: the first)")
    ax.minorticks_off()
    legend_outside(ax)
    ax.grid(alpha=0.3)
    return [save_figure(fig, out / "state_acc_length.png")]


def score_label(score: str) -> str:
    return {"mqar_acc": "MQAR accuracy", "state_acc": "state accuracy (mean over length bands)"}.get(
        score, "val loss (nats/token)")


def plot_best_over(archs: list[Architecture], key: str, out: Path, style: SeriesStyle) -> list[Path]:
    """best_<KEY>/<architecture>.png: the score against KEY (every seed a dot, the mean a line, the best marked), and
    all_<score>.png (plot_architectures_together)."""
    plt = pyplot()
    folder = out / f"best_{key.replace('.', '_')}"
    folder.mkdir(exist_ok=True)
    written = []
    for a in archs:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        means, look = a.means(), style(a.label)
        color = look["color"]
        x = {v: v if numeric(means) else i for i, v in enumerate(means)}  # names (a parametrization) sit at 0, 1, ...
        for v, scores in a.points.items():
            ax.plot([x[v]] * len(scores), scores, "o", color=color, alpha=0.5, ms=4)
        ax.plot([x[v] for v in means], list(means.values()), color=color, linestyle=look["linestyle"])
        best = x[a.pick.value]
        ax.axvline(best, color="gray", ls=":", label=f"best {key} = {value_text(a.pick.value)}")
        log = numeric(means) and all(v > 0 for v in means)
        if len(means) == 1:  # one value: a window around it (matplotlib warns on an empty range)
            ax.set_xlim(*((best / 2, best * 2) if log else (best - 1, best + 1)))
        if log:
            ax.set_xscale("log")
        if not numeric(means):
            ax.set_xticks(list(x.values()), [str(v) for v in x], fontsize=8)
        ax.set(xlabel=key, ylabel=score_label(a.score))
        ax.set_title(a.label, fontsize=9)
        legend_outside(ax)
        ax.grid(alpha=0.3)
        written.append(save_figure(fig, folder / (re.sub(r"[^A-Za-z0-9._=-]+", "_", a.label) + ".png")))
    return written + plot_architectures_together(archs, key, folder, style)


def plot_architectures_together(archs: list[Architecture], key: str, folder: Path, style: SeriesStyle) -> list[Path]:
    """all_<score>.png: every architecture's score against a numeric KEY on one axis, the mean over seeds as the line
    and their min-max as a band, one plot per score kind with at least two architectures (e.g. val loss against the
    number of experts per router, as Clark et al. 2022 plot it)."""
    written = []
    for score in ("val_loss", *ACCURACIES):
        group = [a for a in archs if a.score == score]
        if len(group) < 2 or not all(numeric(a.means()) for a in group):
            continue
        fig, ax = pyplot().subplots(figsize=(6, 4))
        for a in group:
            mean_band(ax, [[(v, y) for y in scores] for v, scores in a.points.items()], a.label, style(a.label))
        if all(v > 0 for a in group for v in a.means()):
            ax.set_xscale("log")
        values = sorted({v for a in group for v in a.means()})
        ax.set_xticks(values, [value_text(v) for v in values])
        ax.minorticks_off()
        ax.set(xlabel=key, ylabel=score_label(score))
        legend_outside(ax)
        ax.grid(alpha=0.3)
        written.append(save_figure(fig, folder / f"all_{score}.png"))
    return written
