"""Runs as the report reads them: the Run record, and the reader of a local run dir (metrics.jsonl, config.yaml,
run_info.json, final/ and eval.py's eval.json); W&B offline run folders and W&B API runs are read into the same
record by analysis/wandb_runs.py, and report.py's discover finds them all under any folders given."""
import json
from dataclasses import dataclass, field
from pathlib import Path

from runs.metrics import read_metrics


@dataclass
class Run:
    name: str
    source: str  # where it was read from
    config: dict  # the resolved train.py config
    rows: list[dict]  # metrics rows, each with "step"
    params: dict | None = None
    complete: bool = True
    note: str = ""
    summary: dict = field(default_factory=dict)  # eval.py's scores under eval/ (eval/step_N/ for a checkpoint)
    group: str = ""
    info: dict = field(default_factory=dict)  # run_info.json
    report: dict = field(default_factory=dict)  # eval.py's final/eval/eval.json (its suites' blocks)
    overrides: list[str] | None = None  # train.py's command-line overrides (Hydra's .hydra/overrides.yaml)
    handle: object = None  # the wandb.Api run it was read from


def cfg_get(config: dict, dotted: str, default=None):
    d = config
    for k in dotted.split("."):
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def read_local(run_dir: Path) -> Run:
    from omegaconf import OmegaConf

    cfg_file = next((p for p in (run_dir / "config.yaml", run_dir / "final" / "training_config.yaml") if p.exists()), None)
    config = OmegaConf.to_container(OmegaConf.load(cfg_file)) if cfg_file else {}
    info = json.loads((run_dir / "run_info.json").read_text()) if (run_dir / "run_info.json").exists() else {}
    overrides = run_dir / ".hydra" / "overrides.yaml"
    run = Run(run_dir.name, str(run_dir), config, read_metrics(run_dir), info.get("params"), group=info.get("group") or "",
              info=info, overrides=OmegaConf.to_container(OmegaConf.load(overrides)) if overrides.exists() else None)
    if not (run_dir / "final").exists():
        run.complete, run.note = False, "no final/ (unfinished or failed)"
    for report in [run_dir / "final" / "eval" / "eval.json", *sorted(run_dir.glob("checkpoints/step_*/eval/eval.json"))]:
        if report.exists():
            data = json.loads(report.read_text())
            prefix = "eval/" if report.parts[-3] == "final" else f"eval/{report.parts[-3]}/"
            run.summary.update({prefix + k: v for k, v in data.get("scores", {}).items()})
            if prefix == "eval/":
                run.report = data
    return run
