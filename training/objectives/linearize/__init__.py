"""`objective=linearize`: a trained softmax model linearized (experiment=linearize, docs/linearize.md). This
run's model, the student, starts from a frozen softmax teacher (init_from) and learns from it in up to three
stages that split the run's steps (configs/train.yaml linearize.*):

    transfer  steps [0, transfer_steps): every student mixer runs on the teacher's own mixer input and
              is fit to the teacher's attention on it (LoLCATs' attention transfer, Zhang et al. 2024): with
              transfer_target=mixer_core (LoLCATs') the core c, the input of the mixer's output projection
              (y = o_proj(c)), against the teacher's, o_proj and q/k/v frozen; with output, y itself. The loss
              sums over layers mean (c_s - c_t)^2 (mse) or sum (c_s - c_t)^2 / sum c_t^2 (relative). Only
              `transfer_parameters` train; where there are none the stage is skipped.
    distill   the next distill_steps: T^2 KL(softmax(z_t / T) || softmax(z_s / T)) per predicted token
              + ce_weight CE (logit distillation, Hinton et al. 2015; RADLADS' second stage).
    finetune  the rest, up to trainer.max_steps: the LM loss.

keep_softmax=auto:<m> keeps m of the linearized layers softmax, chosen before the run: after select_steps
transfer steps on a copy of the all-linear student, each layer is scored by how much restoring it to the
teacher's attention lowers the student's KL to the teacher on val batches (KL-guided layer selection, as in
fla's hybrid distillation); the best m are kept, and the run's config records them as a list.

The stage is a function of the step, so a checkpoint resumes inside any stage. The teacher lives outside
the student's module tree: DDP, the optimizer, checkpoints and the export see only the student.

Here: the objective and its stage schedule; linearization.py the student beside its teacher; teacher.py the
teacher and which layers stay softmax; losses.py what the stages fit; options.py the linearize.* keys' rules and
checks.
"""
import copy

import torch
import torch.nn as nn
from omegaconf import OmegaConf

from training.objectives import OBJECTIVES, Objective
from training.objectives.linearize import options
from training.objectives.linearize.linearization import Linearization
from training.objectives.linearize.teacher import (kl_with_each_layer_softmax, load_teacher, parse_keep_softmax,
                                                    teacher_state_for, with_softmax_layers)


def stage_at(step: int, lc) -> str:
    """The stage of the step that follows `step` steps done (lc: the linearize config)."""
    if step < lc.transfer_steps:
        return "transfer"
    return "distill" if step < lc.transfer_steps + lc.distill_steps else "finetune"


def stage_ends(lc, max_steps: int) -> dict[int, str]:
    """{step count at which a stage ends: that stage} for the stages that run and are followed by another."""
    ends = {}
    if lc.transfer_steps:
        ends[lc.transfer_steps] = "transfer"
    if lc.distill_steps:
        ends[lc.transfer_steps + lc.distill_steps] = "distill"
    return {step: stage for step, stage in ends.items() if step < max_steps}


def uses_teacher(lc) -> bool:
    return lc.transfer_steps + lc.distill_steps > 0


@OBJECTIVES.register("linearize")
class Linearize(Objective):
    """The student beside its teacher (Linearization), in the stage of each step; the student as it starts
    (the teacher's weights, its own mixers) is evaluated before the first step. Without a transfer or distill
    stage no teacher is loaded: the run fine-tunes init_from as objective=lm does. keep_softmax makes the
    student's named layers softmax, or (auto:<m>) the m its selection picks (select_layers)."""
    rules = options.RULES
    cross_checks = staticmethod(options.cross_checks)
    steps_problems = staticmethod(options.steps_problems)

    def __init__(self, cfg, lm: nn.Module, state, data):
        from accelerate.utils import DistributedType

        self.lc, self.teacher, self.linearization = cfg.linearize, None, None
        self.selection: dict[str, float] = {}
        self.selection_line = None
        keep = parse_keep_softmax(self.lc.keep_softmax, lm.config.layer_mixers)
        if uses_teacher(self.lc):
            if state.distributed_type == DistributedType.FSDP:
                raise ValueError("objective=linearize with FSDP: not supported yet (the transfer stage calls each layer's "
                                 "mixer outside its FSDP unit; use DDP)")
            self.teacher = load_teacher(cfg.init_from, lm.config).to(state.device)
        if isinstance(keep, int):
            if self.teacher is None:
                raise ValueError(f"linearize.keep_softmax={self.lc.keep_softmax} scores layers against the teacher, but "
                                 "transfer_steps and distill_steps are 0; valid: a list of layers, or a transfer or "
                                 "distill stage")
            keep = self.select_layers(cfg, lm, state, data, keep)
            cfg.linearize.keep_softmax = keep  # the run's config.yaml holds the layers chosen: a resume keeps them
        if keep:
            with_softmax_layers(lm, keep)
        super().__init__(cfg, lm, state, data)
        if self.teacher is not None:
            self.linearization = Linearization(lm, self.teacher, self.lc, self.new_parameters)

    def select_layers(self, cfg, lm: nn.Module, state, data, m: int) -> list[int]:
        """The m linearized layers whose restoring to the teacher's attention lowers the student's KL to the
        teacher most (KL-guided layer selection): on a copy of the student with the teacher's weights, after
        select_steps steps of the transfer stage (the run's first batches, optimizer and schedule), KL over the
        first eval_batches x batch_size val sequences. Sets self.selection (logged at step 0) and its line."""
        from accelerate.utils import broadcast_object_list

        from data.batches import global_batch, micro_batches
        from runs.checkpoint import load_matching_weights
        from training.optim import build_optimizer, build_scheduler

        tc = cfg.trainer
        probe = copy.deepcopy(lm).to(state.device)
        new = load_matching_weights(probe, teacher_state_for(probe, self.teacher))["new"]
        lin = Linearization(probe, self.teacher, OmegaConf.merge(self.lc, {"transfer_steps": cfg.linearize.select_steps}),
                            new)
        steps = cfg.linearize.select_steps if lin.transfer_parameters else 0
        if steps:  # as the run builds them, over every parameter (those without a gradient stay as they are)
            optimizer = build_optimizer(probe, cfg.optimizer, tc.lr)
            scheduler = build_scheduler(optimizer, tc)
            lin.set_stage("transfer")
            for step in range(steps):
                indices = global_batch(step, len(data.train), tc.batch_size, cfg.seed)
                for shard in micro_batches(indices, tc.grad_accum, 0, 1):
                    batch = {k: v.to(state.device) for k, v in data.train.batch(shard).items()}
                    (lin(**batch).loss / tc.grad_accum).backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        probe.eval()
        sequences = len(data.val) if tc.eval_batches is None else min(len(data.val), tc.eval_batches * tc.batch_size)
        batches = [{k: v.to(state.device) for k, v in data.val.batch(idx).items()}
                   for idx in torch.arange(sequences).split(tc.batch_size // tc.grad_accum)]
        linear_kl, kls = kl_with_each_layer_softmax(probe, self.teacher, batches, lin.linearized)
        gains = {i: linear_kl - kl for i, kl in kls.items()}
        chosen = [sorted(gains, key=lambda i: -gains[i])[:m]]
        broadcast_object_list(chosen)  # every process keeps the main process's layers
        chosen = sorted(chosen[0])
        self.selection = {"linearize/select/kl": linear_kl,
                          **{f"linearize/select/layer{i}/kl_gain": gain for i, gain in gains.items()},
                          **{f"linearize/select/layer{i}/kept": float(i in chosen) for i in gains}}
        how = f"after {steps} transfer steps" if steps else "zero-shot (the transfer stage has nothing to train)"
        self.selection_line = (
            f"keep_softmax={self.lc.keep_softmax}: KL to the teacher on {sequences} val sequences, {how}: all linear "
            f"{linear_kl:.4f}; the gain of restoring each layer to softmax: "
            + ", ".join(f"layer {i} {g:.4f}" for i, g in gains.items()) + f"; kept softmax: layers {chosen}")
        state.print(self.selection_line)
        return chosen

    def initial_weights(self):
        return self.cfg.init_from if self.teacher is None else teacher_state_for(self.lm, self.teacher)

    @property
    def module(self) -> nn.Module:
        return self.lm if self.linearization is None else self.linearization

    @property
    def evaluates_at_start(self) -> bool:
        return self.linearization is not None

    @property
    def start_metrics(self) -> dict[str, float]:
        return self.selection

    @property
    def may_leave_parameters_unused(self) -> bool:  # the stages train different sets
        return self.linearization is not None or super().may_leave_parameters_unused

    def begin_step(self, step: int) -> None:
        if self.linearization is not None:
            stage = stage_at(step, self.linearization.plan)
            self.linearization.set_stage(stage)

    def phase_ends(self, max_steps: int) -> dict[int, str]:
        return stage_ends(self.linearization.plan, max_steps) if self.linearization is not None else {}

    def describe(self, max_steps: int) -> str | None:
        return self.linearization.describe(max_steps) if self.linearization is not None else None

    def flops_schedule(self, seq_len: int, device) -> list[tuple[int, float]]:
        """Each stage that runs at its own cost (Linearization.flops_per_token), from its first step."""
        if self.linearization is None:
            return super().flops_schedule(seq_len, device)
        lc = self.lc
        stages = [("transfer", 0, lc.transfer_steps), ("distill", lc.transfer_steps, lc.distill_steps),
                  ("finetune", lc.transfer_steps + lc.distill_steps, 1)]
        return [(start, self.linearization.flops_per_token(stage, seq_len, device))
                for stage, start, steps in stages if steps]
