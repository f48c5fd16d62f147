"""A run's own plots, from its metrics.jsonl, drawn at the end of training: the loss curves, for MoE runs the
expert-load heatmap and the imbalance curve (the `moe/...` metrics of model/ffn/moe.py), and for state-tracking runs
the accuracy against length (the `val/state_acc/<len>` bands of data/state_tracking.py); with the pieces the report's
comparisons of runs draw alike (analysis/plots.py). Each takes the rows read once (runs/metrics.py read_metrics)."""
import json
import re
from pathlib import Path

from common.plots import legend_outside, pyplot, save_figure


def plot_run(run_dir: Path, rows: list[dict]) -> list[Path]:
    """Every plot of the run the rows (its metrics.jsonl) call for, written into run_dir: the loss curves (loss.png);
    MoE: the load heatmap and the imbalance; state tracking: the accuracy against length."""
    run_dir = Path(run_dir)
    figures = {**loss_curves(run_dir, rows), **moe_load(run_dir, rows), **state_accuracy(run_dir, rows)}
    return [save_figure(fig, run_dir / name) for name, fig in figures.items()]


def loss_curves(run_dir: Path, rows: list[dict]) -> dict:
    """{"loss.png": train/val loss against tokens seen}, or {} without train rows."""
    train = [(r["tokens_seen"], r["train/loss"]) for r in rows if "train/loss" in r]
    val = [(r["tokens_seen"], r["val/loss"]) for r in rows if "val/loss" in r]
    if not train:
        return {}
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="val")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(Path(run_dir).name)
    ax.legend()
    fig.tight_layout()
    return {"loss.png": fig}


LOAD = re.compile(r"^moe/layer(\d+)/load$")
IMBALANCE = re.compile(r"^moe/layer(\d+)/imbalance$")


def load_rows(rows: list[dict]) -> list[dict]:
    """The rows that log an expert load (moe/layer<i>/load)."""
    return [r for r in rows if any(LOAD.match(k) for k in r)]


def load_layers(rows: list[dict]) -> list[int]:
    """The layers whose expert loads the rows log, in order."""
    return sorted({int(m.group(1)) for r in rows for k in r if (m := LOAD.match(k))})


def load_grid(row: dict, layers: list[int]):
    """One row's expert loads as a layer x expert array (NaN for a layer it did not log)."""
    import numpy as np

    return np.array([row.get(f"moe/layer{i}/load", np.nan) for i in layers], dtype=float)


def moe_load(run_dir: Path, rows: list[dict], last_n: int = 10) -> dict:
    """{"moe_load_heatmap.png": each layer's expert loads at the last log and over the last_n, "moe_imbalance.png":
    max / mean load against steps}, those the rows log."""
    loads = load_rows(rows)
    imbalance = [r for r in rows if any(IMBALANCE.match(k) or k == "moe/imbalance" for k in r)]
    if not loads and not imbalance:
        return {}
    import numpy as np

    plt = pyplot()
    figures = {}
    if loads:
        layers = load_layers(loads)
        recent = loads[-last_n:]
        final = load_grid(loads[-1], layers)
        mean = np.array([np.mean([r[f"moe/layer{i}/load"] for r in recent if f"moe/layer{i}/load" in r], axis=0)
                         for i in layers], dtype=float)
        E = final.shape[1]
        fig, axes = plt.subplots(1, 2, figsize=(2.5 + 0.5 * E * 2, 1.5 + 0.45 * len(layers)), squeeze=False,
                                 sharey=True)
        vmax = max(np.nanmax(final), np.nanmax(mean))
        panels = [(final, f"step {loads[-1]['step']}"),
                  (mean, f"mean of last {len(recent)} logs (steps {recent[0]['step']}-{recent[-1]['step']})")]
        for ax, (grid, title) in zip(axes[0], panels):
            im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=vmax)
            ax.set_xticks(range(E))
            ax.set_yticks(range(len(layers)), [f"layer {i}" for i in layers])
            ax.set_xlabel("expert")
            ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=axes[0].tolist(), label=f"share of assignments (uniform = 1/{E} = {1 / E:.3f})")
        fig.suptitle(f"MoE expert load: {run_dir.name}", fontsize=10)
        figures["moe_load_heatmap.png"] = fig
    if imbalance:
        layers = sorted({int(m.group(1)) for r in imbalance for k in r if (m := IMBALANCE.match(k))})
        fig, ax = plt.subplots(figsize=(6, 4))
        for i in layers:
            pts = [(r["step"], r[f"moe/layer{i}/imbalance"]) for r in imbalance if f"moe/layer{i}/imbalance" in r]
            ax.plot(*zip(*pts), lw=1, label=f"layer {i}")
        pts = [(r["step"], r["moe/imbalance"]) for r in imbalance if "moe/imbalance" in r]
        if pts:
            ax.plot(*zip(*pts), "k-", lw=2, label="mean over layers")
        ax.axhline(1.0, color="grey", ls=":", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("max load / mean load")
        ax.set_title(f"MoE imbalance: {run_dir.name}", fontsize=10)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        figures["moe_imbalance.png"] = fig
    return figures


STATE_ACC = re.compile(r"^val/state_acc/(\d+)$")


def state_accuracy(run_dir: Path, rows: list[dict]) -> dict:
    """{"state_acc.png": each length band's accuracy at the band's length L (prefix lengths (L/2, L]; log2 axis), one
    line per evaluation (the last one bold), chance (1 / the group's order, from run_info.json) and the training
    length (the first band's)}, or {} without state-tracking evaluations."""
    evals = [r for r in rows if any(STATE_ACC.match(k) for k in r)]
    if not evals:
        return {}
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, row in enumerate(evals):
        points = sorted((int(m.group(1)), v) for k, v in row.items() if (m := STATE_ACC.match(k)))
        last = i == len(evals) - 1
        ax.plot(*zip(*points), "o-", color="C0" if last else "grey", lw=2 if last else 0.8,
                alpha=1.0 if last else 0.3 + 0.5 * i / len(evals), ms=4 if last else 2, label=f"step {row['step']}")
    lengths = [x for x, _ in points]
    info = json.loads((run_dir / "run_info.json").read_text()) if (run_dir / "run_info.json").exists() else {}
    if order := info.get("data_info", {}).get("group_order"):
        ax.axhline(1 / order, color="black", ls=":", lw=1, label=f"chance 1/{order}")
    ax.axvline(lengths[0], color="black", ls="--", lw=0.8, label=f"training length {lengths[0]}")
    state_accuracy_axes(ax, lengths, "length L (the band of prefix lengths (L/2, L])")
    ax.set_title(f"state tracking: {run_dir.name}", fontsize=10)
    legend_outside(ax)
    return {"state_acc.png": fig}


def state_accuracy_axes(ax, lengths: list[int], xlabel: str) -> None:
    """State accuracy in [0, 1.02] against the length bands L on a log2 axis, a tick at each L."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(x) for x in lengths])
    ax.set(xlabel=xlabel, ylabel="state accuracy", ylim=(0, 1.02))
