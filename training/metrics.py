"""Metric sinks: <run_dir>/metrics.jsonl (always, main process) and the Accelerate trackers (W&B,
offline unless logged in). Vector metrics (per-expert loads) go to jsonl as lists and to W&B as
histograms."""
import json
import math
import netrc
import os
from pathlib import Path

import torch


def wandb_mode(requested: str) -> str:
    """'auto' -> online if an API key is available (env or ~/.netrc), else offline: a first run
    never asks for a key. WANDB_MODE in the environment wins."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        return "online" if netrc.netrc().authenticators("api.wandb.ai") else "offline"
    except (FileNotFoundError, netrc.NetrcParseError):
        return "offline"


def to_python(value):
    if torch.is_tensor(value):
        value = value.detach().float().cpu()
        return value.item() if value.numel() == 1 else value.tolist()
    return value


class MetricsWriter:
    def __init__(self, accelerator, run_dir: Path, use_tracker: bool):
        self.accelerator = accelerator
        self.path = Path(run_dir) / "metrics.jsonl"
        self.use_tracker = use_tracker

    def log(self, metrics: dict, step: int) -> None:
        if not self.accelerator.is_main_process:
            return
        row = {"step": step, **{k: to_python(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.use_tracker:
            import wandb

            tracked = {k: wandb.Histogram(v) if isinstance(v, list) else v for k, v in row.items() if k != "step"}
            self.accelerator.log(tracked, step=step)


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def plot_loss_curves(run_dir: Path) -> Path | None:
    """train/val loss against tokens seen -> <run_dir>/loss.png."""
    rows = read_metrics(run_dir)
    train = [(r["tokens_seen"], r["train/loss"]) for r in rows if "train/loss" in r]
    val = [(r["tokens_seen"], r["val/loss"]) for r in rows if "val/loss" in r]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
