"""Training objectives: what a run minimises, chosen by `objective=<name>` (configs/train.yaml), one module
each here (a file, or a package: linearize/), registered by name (`@OBJECTIVES.register("<name>")`): a new objective
is its module and its config keys, with their rules.

The loop (training/loop.py) sees only this interface:

    objective = OBJECTIVES.get(cfg.objective)(cfg, lm, state, data)
        loads what the run starts from (init_from's matching weights) and sets what trains (trainer.trainable);
        state: Accelerate's PartialState (device, distributed type); data: the run's (data/types.py Data)
    objective.module              what the loop forwards and Accelerate prepares: forward(input_ids, labels,
                                  position_ids) -> LMOutput whose .loss is minimised, .lm_loss logged as train/loss
    objective.begin_step(step)    before the step that follows `step` steps done, and before a checkpoint saved
                                  after `step + 1` steps is loaded (its optimizer state covers what that step trained)
    objective.phase_ends(max_steps) -> {step: phase}   where a phase ends: the loop logs and evaluates there
    objective.evaluates_at_start  the loop evaluates once before the first step (a student zero-shot)
    objective.start_metrics       {name: value} logged with that evaluation (what the objective measured at setup)
    objective.may_leave_parameters_unused   some steps leave parameters without a gradient (DDP must search)
    objective.describe(max_steps) -> str | None   the plan, printed at the start
    objective.flops_schedule(seq_len, device) -> [(first step, training FLOPs per token)]   what each step costs
                                  from that step on (training/budget.py StepCosts: the budget, flops_seen, MFU):
                                  the model's parts at 3x forward where they train and 1x where frozen, plus
                                  whatever else the objective runs (a teacher's forward)

and train.py's config check (training/validation.py) reads, of every registered objective (their keys are in every
config, whichever objective it names):

    Objective.rules               {dotted key: Rule} of its own config keys (common/validation.py)
    Objective.cross_checks(config, problems)   its checks between keys (config: the resolved config as dicts)
    Objective.steps_problems(config) -> [line]   its checks that need trainer.max_steps

The base class is the language-modelling loss itself (`objective=lm`, model/lm.py: CE + the blocks' aux losses)."""
import importlib
import pkgutil

import torch.nn as nn

from common.registry import Registry

OBJECTIVES = Registry("objective")


@OBJECTIVES.register("lm")
class Objective:
    """Next-token cross-entropy plus the blocks' aux losses, on the model itself."""
    evaluates_at_start = False
    start_metrics: dict = {}
    rules: dict = {}

    @staticmethod
    def cross_checks(config: dict, problems) -> None:
        pass

    @staticmethod
    def steps_problems(config: dict) -> list[str]:
        return []

    def __init__(self, cfg, lm: nn.Module, state, data):
        from runs.checkpoint import load_matching_weights

        self.cfg, self.lm = cfg, lm
        self.new_parameters: list[str] = []  # parameters init_from did not have
        if cfg.init_from:
            report = load_matching_weights(lm, self.initial_weights())
            self.new_parameters = report["new"]
            state.print(f"init_from {cfg.init_from}: loaded {len(report['loaded'])} tensors; "
                        f"new: {report['new'] or 'none'}; unused: {report['unused'] or 'none'}; "
                        f"shape mismatch: {report['shape_mismatch'] or 'none'}")
        set_trainable(lm, cfg.trainer.trainable)

    def initial_weights(self):
        """What init_from loads the matching tensors from: a path, or a state dict."""
        return self.cfg.init_from

    @property
    def module(self) -> nn.Module:
        return self.lm

    @property
    def may_leave_parameters_unused(self) -> bool:  # trainer.trainable freezes the rest
        return bool(self.cfg.trainer.trainable)

    def begin_step(self, step: int) -> None:
        pass

    def phase_ends(self, max_steps: int) -> dict[int, str]:
        return {}

    def describe(self, max_steps: int) -> str | None:
        return None

    def flops_schedule(self, seq_len: int, device) -> list[tuple[int, float]]:
        """Every step trains the parameters that require gradients (trainer.trainable's)."""
        from runs.flops import training_flops_per_token

        return [(0, training_flops_per_token(self.lm, seq_len, device))]


def set_trainable(lm: nn.Module, trainable) -> None:
    """trainer.trainable: with a list of substrings, only the parameters whose name holds one require gradients."""
    if trainable:
        for name, p in lm.named_parameters():
            p.requires_grad_(any(s in name for s in trainable))
        if not any(p.requires_grad for p in lm.parameters()):
            raise ValueError(f"trainer.trainable={list(trainable)} matches no parameter name")


for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
