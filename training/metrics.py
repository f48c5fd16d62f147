"""Metric sinks: <run_dir>/metrics.jsonl (always, main process) and the Accelerate trackers (W&B,
offline unless logged in). Vector metrics (per-expert loads) go to jsonl as lists and to W&B as
histograms."""
import json
import math
import netrc
import os
import secrets
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


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


class Meter:
    """The logging window: sums over the optimizer steps since the last log row."""

    def __init__(self):
        self.loss, self.steps, self.seconds, self.aux = 0.0, 0, 0.0, {}

    def add(self, loss: float, seconds: float, aux: dict) -> None:
        self.loss += loss
        self.steps += 1
        self.seconds += seconds
        for k, v in aux.items():
            self.aux[k] = self.aux.get(k, 0) + v

    def row(self, tokens_per_step: int, flops_per_token: float) -> dict:
        """Means over the window (and throughput over its wall time, all processes together); then
        the window restarts."""
        n = self.steps
        tok_s = tokens_per_step * n / self.seconds
        out = {"train/loss": self.loss / n, "train/ppl": perplexity(self.loss / n), "perf/tokens_per_sec": tok_s,
               "perf/step_time": self.seconds / n, "perf/tflops": flops_per_token * tok_s / 1e12,
               **{k: v / n for k, v in self.aux.items()}}
        self.__init__()
        return out


def init_wandb(accelerator, cfg, run_dir: Path, counts: dict) -> None:
    """One W&B run per training run: its id is kept in <run_dir>/wandb_run_id, and a resumed run
    continues it (resume="allow")."""
    from accelerate.utils import broadcast_object_list
    from omegaconf import OmegaConf

    id_file = run_dir / "wandb_run_id"
    run_id = [None]
    if accelerator.is_main_process:
        if not id_file.exists():
            id_file.write_text(secrets.token_hex(4))  # the shape of W&B's own ids: 8 lowercase characters
        run_id = [id_file.read_text().strip()]
    broadcast_object_list(run_id)
    arch = {"mixer": OmegaConf.to_container(cfg.model.mixer) if cfg.model.mixer else cfg.mixer.name,
            "ffn": OmegaConf.to_container(cfg.model.ffn) if cfg.model.ffn else cfg.ffn.name, "size": cfg.model.size}
    accelerator.init_trackers(
        cfg.logger.project, config={**OmegaConf.to_container(cfg, resolve=True), "params": counts, "arch": arch},
        init_kwargs={"wandb": {"name": f"{cfg.name}-{run_dir.name}", "group": cfg.logger.group, "id": run_id[0],
                               "resume": "allow", "dir": str(run_dir), "mode": wandb_mode(cfg.logger.mode),
                               "tags": [str(arch["mixer"]), str(arch["ffn"]), str(arch["size"]), *cfg.logger.tags]}})
