"""The jobs of a sweep, checked before any starts: scripts/sweep.py and `train.py -m` compose every
job's config and run the checks a new run makes before it touches data (training/validation.py, the
block options by building the model on the meta device, the steps a budget buys), so that a bad job
stops the sweep in one line before its first job runs rather than each job failing in turn."""
from omegaconf import open_dict

from training.config import CONFIG_DIR, register_hydra


def compose(overrides: list[str], hydra: bool = False):
    """The train.py config of these overrides (hydra.* ones dropped; with hydra=True, Hydra's own node
    too), without running anything."""
    from hydra import compose as hydra_compose, initialize_config_dir

    register_hydra()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose("train", [o for o in overrides if not o.lstrip("+~").startswith("hydra.")],
                             return_hydra_config=hydra)


def meta_model(cfg, intermediate_size: int | None = None):
    """The DecoderLM of the config on the meta device (no memory, no init); building it checks the block
    options. The vocabulary is data.vocab_size (8192 if the data has none): the data's own may differ."""
    import torch

    from model import DecoderLM
    from training.config import lm_config

    if intermediate_size is not None:
        with open_dict(cfg):
            cfg.model.intermediate_size = intermediate_size
    with torch.device("meta"):
        return DecoderLM(lm_config(cfg, cfg.data.get("vocab_size") or 8192, None))


def check_job(cfg, overrides: list[str]):
    """train.py's checks of a new run with these overrides, on its composed config: the values, the
    block options, and with a budget the steps it buys on this machine's device, where the jobs run (from the
    meta model with trainer.trainable applied: the lm head's FLOPs use data.vocab_size, and an objective's
    stages (a linearization teacher's forward) are not counted, so the run's own count may differ). Returns
    the model."""
    from training.budget import StepCosts, budget_replaces_steps, set_steps_from_budget, training_flops_per_token
    from training.objectives import set_trainable
    from training.run import device_type
    from training.validation import check_steps, check_train_config

    budget_replaces_steps(cfg, overrides)
    check_train_config(cfg)
    lm = meta_model(cfg)
    set_trainable(lm, cfg.trainer.trainable)
    tc = cfg.trainer
    per_token = training_flops_per_token(lm, tc.seq_len, device_type())
    if set_steps_from_budget(cfg, StepCosts([(0, per_token)], tc.batch_size * tc.seq_len)):
        check_steps(cfg)
    return lm


def multirun_jobs(overrides: list[str]) -> list[list[str]]:
    """The jobs `train.py -m <overrides>` runs, as Hydra's basic sweeper expands them: the config's
    hydra.sweeper.params (an experiment's default axes), then the command line's, which win."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    first = [o for o in overrides if "," not in o.partition("=")[2]]  # enough to find the experiment's axes
    params = compose(first, hydra=True).hydra.sweeper.params or {}
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + overrides)
    return BasicSweeper.split_arguments(parsed, None)[0]


def check_multirun(overrides: list[str]) -> None:
    """Every job of `train.py -m <overrides>` checked (check_job) before Hydra launches the first: every
    problem of every job at once, one line each naming its job."""
    jobs, problems = multirun_jobs(overrides), []
    for i, job in enumerate(jobs):
        try:
            check_job(compose(job), job)
        except ValueError as e:
            problems += [f"job {i} of {len(jobs)} ({' '.join(job)}): {line}" for line in str(e).splitlines()]
    if problems:
        raise ValueError("\n".join(problems))
