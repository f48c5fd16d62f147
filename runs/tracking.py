"""W&B as the place where runs are compared (through Accelerate's tracker; offline unless logged in): the tracker
of training (init_run, finish_run) and of eval.py (log_evaluation).

One W&B run per training run, its id kept in <run_dir>/wandb_run_id (a resumed run and `eval.py`
continue it). What a run carries, so that a project page sorts itself into comparisons:
- group: one per comparison. logger.group if set (scripts/sweep.py sets one id for all its jobs);
  else, in a `train.py -m` sweep, the experiment (or run name) plus the sweep folder's date and time;
  else the experiment or run name.
- job_type: the architecture, `architecture(cfg)` (e.g. "gdn:softmax 3:1-moe-tiny"); tags: the mixer
  schedule, the FFN schedule, the size, the optimizer, lr=, seed= and logger.tags. A per-layer list
  becomes one short tag (`schedule_tag`), never the raw list (W&B caps tags at 64 characters).
- metric definitions: tokens_seen is the x-axis of train/, val/, perf/ and moe/; val/loss and val/bpb
  are summarised by their minimum.
- at the end (`finish_run`): the summary (parameters, best val loss/bpb, median tokens/s and MFU,
  wall time), the end-of-run plots as images, and the per-expert loads as a table.
"""
import math
import netrc
import os
import secrets
from collections import Counter
from pathlib import Path

from runs.metrics import logged, median_after_first
from runs.plots import LOAD

TAG_LIMIT = 64  # W&B's limit on a tag's length
STEP_METRIC = "tokens_seen"
STEPPED = ("train/*", "val/*", "perf/*", "moe/*", "linearize/*", "lr", "grad_norm", "time/*")
MINIMISED = ("val/loss", "val/bpb")


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


def schedule_tag(kinds: list[str]) -> str:
    """A per-layer schedule as kinds and their ratio, most frequent first: [softmax, gdn, gdn, gdn]
    -> 'gdn:softmax 3:1'; one kind -> its name. At most TAG_LIMIT characters."""
    counts = sorted(Counter(kinds).items(), key=lambda kc: (-kc[1], kc[0]))
    if len(counts) == 1:
        return counts[0][0][:TAG_LIMIT]
    g = math.gcd(*(c for _, c in counts))
    tag = ":".join(k for k, _ in counts) + " " + ":".join(str(c // g) for _, c in counts)
    return tag[:TAG_LIMIT]


def layer_kinds(cfg, group: str) -> list[str]:
    """The per-layer mixer or FFN names of a train.py config (model.<group> list, else the group's name)."""
    given = cfg.model.get(group)
    return [str(k) for k in given] if given else [cfg[group].name] * cfg.model.num_hidden_layers


def architecture(cfg) -> str:
    """'<mixer schedule>-<ffn schedule>-<size>', e.g. 'softmax-dense-tiny', 'gdn:softmax 3:1-moe-125m'."""
    return f"{schedule_tag(layer_kinds(cfg, 'mixer'))}-{schedule_tag(layer_kinds(cfg, 'ffn'))}-{cfg.model.size}"


def run_tags(cfg) -> list[str]:
    tags = [schedule_tag(layer_kinds(cfg, "mixer")), schedule_tag(layer_kinds(cfg, "ffn")), str(cfg.model.size),
            cfg.optimizer.name, f"lr={cfg.trainer.lr:g}", f"seed={cfg.seed}", *map(str, cfg.logger.get("tags") or [])]
    return list(dict.fromkeys(t[:TAG_LIMIT] for t in tags))  # unique, in order


def wandb_group(cfg) -> str:
    """logger.group if set; in a Hydra multirun, the experiment (or run name) and the sweep folder
    (one group per sweep); else the experiment or run name."""
    if cfg.logger.get("group"):
        return str(cfg.logger.group)
    label = cfg.get("experiment_name") or cfg.name
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        sweep_dir = Path(HydraConfig.get().runtime.output_dir).parent  # this job's folder is in the sweep's
        return f"{label}-{sweep_dir.parent.name}_{sweep_dir.name}"
    return label


def init_run(accelerator, cfg, run_dir: Path, counts: dict) -> None:
    """Start (or continue) the run's W&B run through Accelerate, with its group, job type, tags and
    metric definitions."""
    from accelerate.utils import broadcast_object_list
    from omegaconf import OmegaConf

    id_file = run_dir / "wandb_run_id"
    run_id = [None]
    if accelerator.is_main_process:
        if not id_file.exists():
            id_file.write_text(secrets.token_hex(4))  # the shape of W&B's own ids: 8 lowercase characters
        run_id = [id_file.read_text().strip()]
    broadcast_object_list(run_id)
    arch = {"mixer": layer_kinds(cfg, "mixer"), "ffn": layer_kinds(cfg, "ffn"), "size": cfg.model.size,
            "name": architecture(cfg)}
    accelerator.init_trackers(
        cfg.logger.project, config={**OmegaConf.to_container(cfg, resolve=True), "params": counts, "arch": arch},
        init_kwargs={"wandb": {"name": f"{cfg.name}-{run_dir.name}", "group": wandb_group(cfg), "job_type": arch["name"],
                               "id": run_id[0], "resume": "allow", "dir": str(run_dir),
                               "mode": wandb_mode(cfg.logger.mode), "tags": run_tags(cfg)}})
    if accelerator.is_main_process:
        define_metrics(accelerator.get_tracker("wandb", unwrap=True))


def define_metrics(run) -> None:
    run.define_metric(STEP_METRIC)
    for name in STEPPED:
        run.define_metric(name, step_metric=STEP_METRIC)
    for name in MINIMISED:
        run.define_metric(name, step_metric=STEP_METRIC, summary="min")


def load_table(rows: list[dict]):
    """Every logged per-expert load as rows (step, tokens_seen, layer, expert, load): a wandb.Table."""
    import wandb

    data = [[r["step"], r.get(STEP_METRIC), int(m.group(1)), e, load] for r in rows for k, v in r.items()
            if (m := LOAD.match(k)) for e, load in enumerate(v)]
    return wandb.Table(columns=["step", STEP_METRIC, "layer", "expert", "load"], data=data) if data else None


def run_summary(rows: list[dict], counts: dict, wall_s: float) -> dict:
    """What a project table shows per run: parameters, best val loss / bpb, median tokens/s and MFU
    over the logs after the first (which includes warm-up), wall time."""
    out = {"params/total": counts["total"], "params/active": counts["active"], "time/wall_s": wall_s,
           "best/val_loss": min(logged(rows, "val/loss"), default=None), "best/val_bpb": min(logged(rows, "val/bpb"), default=None),
           "perf/median_tokens_per_sec": median_after_first(rows, "perf/tokens_per_sec"),
           "perf/median_mfu": median_after_first(rows, "perf/mfu")}
    return {k: v for k, v in out.items() if v is not None}


def finish_run(accelerator, rows: list[dict], counts: dict, wall_s: float, plots: list[Path]) -> None:
    """On the main process: the run's summary (run_summary of its metrics rows, parameter counts and wall time),
    its plots as images and the expert-load table of its rows."""
    import wandb

    run = accelerator.get_tracker("wandb", unwrap=True)
    run.summary.update(run_summary(rows, counts, wall_s))
    media = {f"plots/{p.stem}": wandb.Image(str(p)) for p in plots}
    if (table := load_table(rows)) is not None:
        media["tables/moe_load"] = table
    if media:
        run.log(media)


def log_evaluation(model_dir: Path, scores: dict, images: list[Path]) -> str | None:
    """Continue the W&B run of the training run that `model_dir` belongs to (<run>/final or
    <run>/checkpoints/step_N; the run's id in <run>/wandb_run_id, its logger settings in its
    config.yaml) and put `scores` in its summary under eval/ (eval/step_N/ for a mid-run checkpoint),
    with `images`. Returns the run id, or None when the training run had no W&B run."""
    import wandb
    from omegaconf import OmegaConf

    from runs.checkpoint import STEP_DIR

    model_dir = Path(model_dir).resolve()
    run_dir = next((d for d in (model_dir.parent, model_dir.parent.parent) if (d / "wandb_run_id").exists()), None)
    if run_dir is None or not (run_dir / "config.yaml").exists():
        return None
    prefix = f"eval/{model_dir.name}/" if STEP_DIR.match(model_dir.name) else "eval/"
    logger = OmegaConf.load(run_dir / "config.yaml").logger
    run = wandb.init(project=logger.get("project", "swaplm"), id=(run_dir / "wandb_run_id").read_text().strip(),
                     resume="allow", dir=str(run_dir), mode=wandb_mode(logger.get("mode", "auto")))
    # The summary, not the history: an offline run that continues does not know its last step.
    run.summary.update({**{prefix + k: v for k, v in scores.items()},
                        **{prefix + p.stem: wandb.Image(str(p)) for p in images}})
    run.finish()
    return run.id
