"""Training budgets: `trainer.flops_budget` or `trainer.tokens_budget` sets a run's steps, so that
architectures whose FLOPs per token differ compare at equal compute (or equal tokens) rather than at
equal steps.

    steps = the step count whose training FLOPs come closest to flops_budget          (StepCosts.steps_for)
    steps = round(tokens_budget / tokens per step)                           tokens per step = batch_size x seq_len

A step's training FLOPs per token are the objective's (training/objectives/ flops_schedule): each part of the
model (DecoderLM.flops_by_part) on the path its ops take on the run's device, 3x its forward where any of its
own parameters trains and 1x where none does (runs/flops.py part_costs), 1x the model's forward for each run of it without grad
that its training forward makes (a self-critical router's baseline), plus what the objective runs beside the model
(a teacher's forward). A budget replaces trainer.max_steps: a new run given a budget starts with max_steps=null
(giving both is an error), and training/run.py fills it in from the model as built on the device it runs on
before anything is written; the saved config then holds both, so a resumed run keeps the steps it started with."""
from omegaconf import OmegaConf, open_dict

from common.validation import raise_problems
from runs.config import override_key

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
    given = set(map(override_key, overrides))
    if "trainer.max_steps" in given:
        raise ValueError(f"trainer.max_steps={cfg.trainer.max_steps} and trainer.{key}={cfg.trainer[key]:g}; "
                         f"valid: one of them (a budget sets the steps)")
    with open_dict(cfg):
        cfg.trainer.max_steps = None


class StepCosts:
    """Training FLOPs per token by step, constant between an objective's stage starts: `schedule` is
    [(first step, training FLOPs per token of each step from there)] in step order, from step 0."""

    def __init__(self, schedule: list[tuple[int, float]], tokens_per_step: int):
        if not schedule or schedule[0][0] != 0:
            raise ValueError(f"a cost schedule starts at step 0, not {schedule[:1]}")
        self.schedule, self.tokens_per_step = schedule, tokens_per_step

    def per_token(self, step: int) -> float:
        """Training FLOPs per token of the step that follows `step` steps done."""
        return next(cost for start, cost in reversed(self.schedule) if start <= step)

    def flops_through(self, steps: int) -> float:
        """Training FLOPs of the first `steps` steps."""
        ends = [start for start, _ in self.schedule[1:]] + [max(steps, self.schedule[-1][0])]
        return self.tokens_per_step * sum(cost * (min(end, steps) - start) for (start, cost), end
                                          in zip(self.schedule, ends) if start < steps)

    def steps_for(self, flops: float) -> int:
        """The step count whose training FLOPs come closest to `flops` (round(flops / per step) at one cost)."""
        for (start, cost), (end, _) in zip(self.schedule, self.schedule[1:] + [(None, None)]):
            if end is None or self.flops_through(end) >= flops:
                return start + round((flops - self.flops_through(start)) / (self.tokens_per_step * cost))


def budget_steps(tc, costs: StepCosts) -> int:
    """The steps a budget buys, at least one step's worth."""
    key = given_budget(tc)
    if key == "flops_budget":
        steps, per_step = costs.steps_for(tc[key]), costs.flops_through(1)
    else:
        per_step = tc.batch_size * tc.seq_len
        steps = round(tc[key] / per_step)
    if steps < 1:
        raise ValueError(f"trainer.{key}={tc[key]:g} is under half a step ({per_step:.3g} "
                         f"{'FLOPs' if key == 'flops_budget' else 'tokens'} per step); valid: >= {per_step / 2:.3g}")
    return steps


def set_steps_from_budget(cfg, costs: StepCosts) -> str | None:
    """Fill in trainer.max_steps from the budget if it is null; returns a line saying what was set."""
    tc = cfg.trainer
    if tc.max_steps is not None:
        return None
    steps = budget_steps(tc, costs)
    with open_dict(cfg):
        tc.max_steps = steps
    tokens = steps * tc.batch_size * tc.seq_len
    key = given_budget(tc)
    flops = costs.flops_through(steps)
    return (f"trainer.{key}={tc[key]:.4g}: {steps} steps x {tc.batch_size * tc.seq_len:,} tokens "
            f"x {flops / tokens:.4g} training FLOPs/token = {flops:.4g} FLOPs, {tokens:,} tokens")


def steps_problems(config: dict) -> list[str]:
    """The warm-up and the wsd decay fit in trainer.max_steps."""
    tc = config["trainer"]
    decay = int(tc["max_steps"] * tc["wsd_decay_fraction"])
    if tc["warmup_steps"] > tc["max_steps"]:
        return [f"trainer.warmup_steps={tc['warmup_steps']}; valid: <= trainer.max_steps={tc['max_steps']}"]
    if tc["schedule"] == "wsd" and tc["warmup_steps"] + decay > tc["max_steps"]:
        return [f"trainer.warmup_steps={tc['warmup_steps']}; valid with schedule=wsd: <= trainer.max_steps - the "
                f"{decay} decay steps (wsd_decay_fraction={tc['wsd_decay_fraction']}) = {tc['max_steps'] - decay}"]
    return []


def check_steps(cfg) -> None:
    """The checks that need trainer.max_steps: the warm-up and decay fit in it, so do the objectives' (linearize's
    stages)."""
    from training.objectives import OBJECTIVES

    config = OmegaConf.to_container(cfg, resolve=True)
    raise_problems(steps_problems(config) + [line for name in OBJECTIVES.names()
                                             for line in OBJECTIVES.get(name).steps_problems(config)])
