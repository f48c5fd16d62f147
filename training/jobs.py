"""The jobs of a sweep, checked before any starts: scripts/sweep.py and `train.py -m` compose every
job's config and run the checks a new run makes before it touches data (training/validation.py, the
block options by building the model on the meta device, the steps a budget buys), so that a bad job
stops the sweep in one line before its first job runs rather than each job failing in turn."""
from runs.config import compose, meta_model
from runs.sweep import sweep_jobs


def check_job(cfg, overrides: list[str]):
    """train.py's checks of a new run with these overrides, on its composed config: the values, the
    block options, and with a budget the steps it buys on this machine's device, where the jobs run (from the
    meta model with trainer.trainable applied: the lm head's FLOPs use data.vocab_size, and an objective's
    stages (a linearization teacher's forward) are not counted, so the run's own count may differ). Returns
    the model."""
    from runs.flops import training_flops_per_token
    from training.budget import StepCosts, budget_replaces_steps, check_steps, set_steps_from_budget
    from training.objectives import set_trainable
    from training.run import device_type
    from training.validation import check_train_config

    budget_replaces_steps(cfg, overrides)
    check_train_config(cfg)
    lm = meta_model(cfg)
    set_trainable(lm, cfg.trainer.trainable)
    tc = cfg.trainer
    per_token = training_flops_per_token(lm, tc.seq_len, device_type())
    if set_steps_from_budget(cfg, StepCosts([(0, per_token)], tc.batch_size * tc.seq_len)):
        check_steps(cfg)
    return lm


def check_multirun(overrides: list[str]) -> None:
    """Every job of `train.py -m <overrides>` (runs/sweep.py sweep_jobs) checked (check_job) before Hydra launches
    the first: every problem of every job at once, one line each naming its job."""
    jobs, problems = [job for _, job in sweep_jobs(overrides)], []
    for i, job in enumerate(jobs):
        try:
            check_job(compose(job), job)
        except ValueError as e:
            problems += [f"job {i} of {len(jobs)} ({' '.join(job)}): {line}" for line in str(e).splitlines()]
    if problems:
        raise ValueError("\n".join(problems))
