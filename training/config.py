"""The config of a resumed run: its saved one, with what this command's overrides may change on resume (composing a
new run's config: runs/config.py)."""
from pathlib import Path

from runs.config import override_key

# What an override given on resume may change: nothing that changes the model, the data order or the
# optimizer (a key, or a prefix ending in "." or "_"). The process layout may change (the global batch
# is trainer.batch_size whatever the processes, accumulation, expert or context parallelism).
RESUMABLE = ("trainer.max_steps", "trainer.grad_accum", "trainer.expert_parallel", "trainer.context_parallel", "trainer.log_every", "trainer.eval_every", "trainer.eval_batches", "trainer.ckpt_every",
             "trainer.keep_checkpoints", "trainer.sample_", "trainer.compile", "logger.", "data.num_proc",
             "data.cache_dir", "data.cache_shared", "run_dir", "resume")


def resumable(key: str) -> bool:
    return any(key == r or (r[-1] in "._" and key.startswith(r)) for r in RESUMABLE)


def saved_config_path(resume: str, run_dir: str | None) -> Path | None:
    """The config a resumed run was saved with: <run_dir>/config.yaml for resume=auto, a checkpoint's
    training_config.yaml, or a run dir's config.yaml; None if there is none (a new run)."""
    where = Path(run_dir) if resume == "auto" else Path(resume)
    return next((p for p in (where / "training_config.yaml", where / "config.yaml") if p.exists()), None)


def config_for_resume(cfg, saved, overrides: list[str], saved_path: Path):
    """The saved config of the run being resumed, with those of this command's overrides that may
    change on resume (RESUMABLE) applied. An override that would change anything else is a one-line
    error naming the key, its saved and its new value. A value that differs only because a default
    changed since the run started keeps its saved value; a resumable key the run's config predates takes
    this config's value (e.g. trainer.context_parallel, 1 by default)."""
    from omegaconf import OmegaConf

    from common.validation import leaves

    given = {key for key in map(override_key, overrides) if not key.startswith("hydra.")}
    if "experiment" in given:  # an experiment sets keys anywhere: it is given, or it is the same one
        given.add("experiment_name")
    new = leaves(OmegaConf.to_container(cfg, resolve=True))
    old = leaves(OmegaConf.to_container(saved, resolve=True))
    merged = OmegaConf.create(OmegaConf.to_container(saved, resolve=True))
    missing = object()
    for key in sorted(new.keys() | old.keys(), key=lambda k: (not k.endswith(".name"), k)):  # mixer.name first
        before, after = old.get(key, missing), new.get(key, missing)
        if before == after:
            continue
        touched = any(key == g or key.startswith((g + ".", g + "[")) for g in given)
        if not touched and not (before is missing and resumable(key)):  # a layout key newer than the run: its default
            continue
        if not resumable(key):
            shown = lambda v: "(absent)" if v is missing else repr(v)  # noqa: E731
            raise ValueError(f"resume: {key} was {shown(before)} in {saved_path}, the command gives {shown(after)}; on "
                             f"resume only trainer.max_steps, the log/eval/checkpoint cadences, sampling, trainer.compile, the "
                             f"process layout, logger.* and data caching may change (start a new run_dir to change the rest)")
        if after is missing:  # e.g. logger=none drops logger.project
            parent, _, leaf = key.rpartition(".")
            OmegaConf.select(merged, parent).pop(leaf, None)
        else:
            OmegaConf.update(merged, key, after, force_add=True)
    return merged
