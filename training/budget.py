"""Training budgets: `trainer.flops_budget` or `trainer.tokens_budget` sets a run's steps, so that
architectures whose FLOPs per token differ compare at equal compute (or equal tokens) rather than at
equal steps.

    steps = round(flops_budget / (train FLOPs per token x tokens per step))    train FLOPs = 3 x forward
    steps = round(tokens_budget / tokens per step)                           tokens per step = batch_size x seq_len

A budget replaces trainer.max_steps: a new run given a budget starts with max_steps=null (giving both
is an error), and training/run.py fills it in from the model as built (its `flops_per_token`, MoE
counting active experts only) before anything is written; the saved config then holds both, so a
resumed run keeps the steps it started with."""
from omegaconf import open_dict

BUDGETS = ("flops_budget", "tokens_budget")


def given_budget(tc) -> str | None:
    """The budget key set in cfg.trainer (trainer.flops_budget or trainer.tokens_budget), or None."""
    return next((k for k in BUDGETS if tc.get(k) is not None), None)


def budget_replaces_steps(cfg, overrides: list[str]) -> None:
    """For a new run: with a budget set, trainer.max_steps is null (the budget sets it), unless
    max_steps is also given on the command line, a one-line error."""
    key = given_budget(cfg.trainer)
    if key is None:
        return
    given = {o.lstrip("+~").partition("=")[0] for o in overrides}
    if "trainer.max_steps" in given:
        raise ValueError(f"trainer.max_steps={cfg.trainer.max_steps} and trainer.{key}={cfg.trainer[key]:g}; "
                         f"valid: one of them (a budget sets the steps)")
    with open_dict(cfg):
        cfg.trainer.max_steps = None


def budget_steps(tc, train_flops_per_token: float) -> int:
    """The steps a budget buys: round(budget / cost of one step), at least one step's worth."""
    key = given_budget(tc)
    tokens_per_step = tc.batch_size * tc.seq_len
    per_step = tokens_per_step * (train_flops_per_token if key == "flops_budget" else 1)
    steps = round(tc[key] / per_step)
    if steps < 1:
        raise ValueError(f"trainer.{key}={tc[key]:g} is under half a step ({per_step:.3g} "
                         f"{'FLOPs' if key == 'flops_budget' else 'tokens'} per step); valid: >= {per_step / 2:.3g}")
    return steps


def set_steps_from_budget(cfg, train_flops_per_token: float) -> str | None:
    """Fill in trainer.max_steps from the budget if it is null; returns a line saying what was set."""
    tc = cfg.trainer
    if tc.max_steps is not None:
        return None
    steps = budget_steps(tc, train_flops_per_token)
    with open_dict(cfg):
        tc.max_steps = steps
    tokens = steps * tc.batch_size * tc.seq_len
    key = given_budget(tc)
    return (f"trainer.{key}={tc[key]:.4g}: {steps} steps x {tc.batch_size * tc.seq_len:,} tokens "
            f"x {train_flops_per_token:.4g} training FLOPs/token = {tokens * train_flops_per_token:.4g} FLOPs, "
            f"{tokens:,} tokens")
