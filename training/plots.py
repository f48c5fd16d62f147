"""End-of-run plots from a run's metrics.jsonl: the loss curves, and for MoE runs the expert-load
heatmap and the imbalance curve (the `moe/...` metrics of model/ffn/moe.py)."""
import re
from pathlib import Path

from common.plots import pyplot
from training.metrics import read_metrics


def plot_loss_curves(run_dir: Path) -> Path | None:
    """train/val loss against tokens seen -> <run_dir>/loss.png."""
    rows = read_metrics(run_dir)
    train = [(r["tokens_seen"], r["train/loss"]) for r in rows if "train/loss" in r]
    val = [(r["tokens_seen"], r["val/loss"]) for r in rows if "val/loss" in r]
    if not train:
        return None
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
    out = Path(run_dir) / "loss.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


LOAD = re.compile(r"^moe/layer(\d+)/load$")
IMBALANCE = re.compile(r"^moe/layer(\d+)/imbalance$")


def plot_moe_load(run_dir, last_n: int = 10) -> list[Path]:
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    loads = [r for r in rows if any(LOAD.match(k) for k in r)]
    imbalance = [r for r in rows if any(IMBALANCE.match(k) or k == "moe/imbalance" for k in r)]
    if not loads and not imbalance:
        return []
    import numpy as np

    plt = pyplot()
    written = []
    if loads:
        layers = sorted({int(m.group(1)) for r in loads for k in r if (m := LOAD.match(k))})
        recent = loads[-last_n:]
        final = np.array([loads[-1].get(f"moe/layer{i}/load", np.nan) for i in layers], dtype=float)
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
        out = run_dir / "moe_load_heatmap.png"
        fig.savefig(out, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(out)
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
        out = run_dir / "moe_imbalance.png"
        fig.savefig(out, dpi=120)
        plt.close(fig)
        written.append(out)
    return written
