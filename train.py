"""Train a decoder LM: python train.py [group=choice ...] [key=value ...]

The Hydra entry: compose configs/train.yaml with the command line, check it (a bad value is one line and
leaves nothing on disk), and hand it to the loop (training/loop.py: setup, steps, evaluation,
checkpoints, export). `train.py -m` checks every job of the sweep before the first starts.
"""
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from runs.config import check_group_overrides, register_hydra
from common.validation import error_message

register_hydra()


class JobFailed(RuntimeError):
    """A failed job of a -m sweep: Hydra's launcher records it and starts the next job (a SystemExit
    would end the whole sweep); the sweep exits with status 1 at the end."""


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from training.loop import train

    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        return train(checked_config(cfg, HydraConfig.get().overrides.task))
    except (ValueError, FileNotFoundError) as e:  # configuration and input errors: one line, no traceback,
        remove_hydra_only_dir(Path(HydraConfig.get().runtime.output_dir))  # and no run dir left behind
        message = error_message(e)
    except SystemExit as e:  # non-finite loss: already reported
        if not (multirun and e.code):
            raise
        message = f"error: job exited with status {e.code}"
    if multirun:
        print(message, file=sys.stderr)
        raise JobFailed(message)
    sys.exit(message)


def checked_config(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """The config to train with: on resume, the run's saved config with what may change on resume
    (training/config.py config_for_resume); for a new run with a budget, max_steps left for the budget
    to set (training/budget.py); every value checked (training/validation.py)."""
    from training.budget import budget_replaces_steps
    from training.config import config_for_resume, saved_config_path
    from training.validation import check_train_config

    saved = saved_config_path(cfg.resume, cfg.run_dir) if cfg.resume and (cfg.run_dir or cfg.resume != "auto") else None
    if saved is not None:
        cfg = config_for_resume(cfg, OmegaConf.load(saved), overrides, saved)
    else:
        budget_replaces_steps(cfg, overrides)
    check_train_config(cfg)
    return cfg


def remove_hydra_only_dir(folder: Path) -> None:
    """Hydra's run dir of a job that failed before starting, if it holds only what Hydra wrote, and the
    folders Hydra made for it below the working directory (outputs/<date>/) that are left empty."""
    import shutil

    if folder.is_dir() and {p.name for p in folder.iterdir()} <= {".hydra", "train.log"}:
        shutil.rmtree(folder)
        cwd = Path.cwd().resolve()
        for parent in folder.resolve().parents:
            if parent == cwd or not parent.is_relative_to(cwd) or any(parent.iterdir()):
                break
            parent.rmdir()


if __name__ == "__main__":
    check_group_overrides(sys.argv[1:])
    if {"-m", "--multirun"} & set(sys.argv):  # every job checked before Hydra launches the first
        from training.jobs import check_multirun

        try:
            check_multirun([a for a in sys.argv[1:] if not a.startswith("-")])
        except ValueError as e:
            sys.exit(error_message(e))
    main()
