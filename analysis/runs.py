"""Runs as the report reads them: a local run dir (metrics.jsonl, config.yaml, run_info.json, final/ and eval.py's
eval.json), W&B offline run folders and W&B API runs (analysis/wandb_runs.py), found under any folders given."""
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from training.metrics import read_metrics


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


def natural_key(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def discover(paths: list[Path]) -> tuple[list[Run], list[str]]:
    """Runs under the given paths (a run dir's own wandb/ folder is not read twice; the offline
    folders of one W&B run id are read as one run)."""
    from analysis.wandb_runs import read_wandb_offline

    runs, notes, seen, offline = [], [], set(), {}

    def visit(p: Path):
        if p.resolve() in seen:
            return
        seen.add(p.resolve())
        if (p / "metrics.jsonl").exists():
            runs.append(read_local(p))
        elif list(p.glob("run-*.wandb")):
            run_id = next(p.glob("run-*.wandb")).stem.removeprefix("run-")
            if run_id not in offline:
                offline[run_id] = []
                runs.append(run_id)  # a placeholder, read once all its folders are found
            offline[run_id].append(p)
        elif p.is_dir():
            children = [c for c in p.iterdir() if c.is_dir() and not c.name.startswith(".")]
            for child in sorted(children, key=natural_key):  # sweep jobs in job order: 2_x before 10_x
                visit(child)

    for p in paths:
        if not p.exists():
            notes.append(f"{p}: does not exist")
            continue
        before = len(runs)
        visit(p)
        if len(runs) == before:
            notes.append(f"{p}: no runs found (no metrics.jsonl or run-*.wandb)")
    runs = [read_wandb_offline(sorted(offline[r], key=lambda f: f.name)) if isinstance(r, str) else r for r in runs]
    names = [r.name for r in runs]
    for r in runs:  # jobs of different sweeps share names (0_0): such a local run is named <sweep folder>/<job>
        if names.count(r.name) > 1 and Path(r.source).is_dir():
            r.name = f"{Path(r.source).parent.name}/{r.name}"
    return runs, notes
