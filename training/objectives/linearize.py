"""`objective=linearize`: a trained softmax model linearized (experiment=linearize, docs/linearize.md). This
run's model, the student, starts from a frozen softmax teacher (init_from) and learns from it in up to three
stages that split the run's steps (configs/train.yaml linearize.*):

    transfer  steps [0, transfer_steps): every student mixer runs on the teacher's own mixer input and
              its output is fit to the teacher's attention output on it (LoLCATs' attention transfer,
              Zhang et al. 2024): the loss sums over layers mean (y_s - y_t)^2 (mse) or
              sum (y_s - y_t)^2 / sum y_t^2 (relative). Only `transfer_parameters` train.
    distill   the next distill_steps: T^2 KL(softmax(z_t / T) || softmax(z_s / T)) per predicted token
              + ce_weight CE (logit distillation, Hinton et al. 2015; RADLADS' second stage).
    finetune  the rest, up to trainer.max_steps: the LM loss.

The stage is a function of the step, so a checkpoint resumes inside any stage. The teacher lives outside
the student's module tree: DDP, the optimizer, checkpoints and the export see only the student.
"""
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.layers import AuxCollector, at_least_fp32
from model.lm import LMOutput
from training.objectives import OBJECTIVES, Objective

STAGES = ("transfer", "distill", "finetune")
TEACHER_MIXER = "softmax"


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


# the teacher and the student's start ----------------------------------------------------------------
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim")


def load_teacher(path: str, student_config) -> nn.Module:
    """The frozen teacher at `path` (HF dir, run dir or checkpoint), checked against the student: every
    layer softmax attention, and the student's shape. A mismatch is one line naming what differs."""
    from training.checkpoint import load_lm

    teacher = load_lm(path)
    kinds = teacher.config.layer_mixers
    if any(kind != TEACHER_MIXER for kind in kinds):
        raise ValueError(f"init_from={path}: the teacher's layers are {kinds}; valid: a softmax model "
                         f"(every layer {TEACHER_MIXER}), whose attention the student linearizes")
    differ = [k for k in SHAPE_KEYS if getattr(teacher.config, k) != getattr(student_config, k)]
    if differ:
        shown = ", ".join(f"{k}={getattr(teacher.config, k)} (student {getattr(student_config, k)})" for k in differ)
        raise ValueError(f"init_from={path}: the teacher has {shown}; valid: a student of the teacher's shape "
                         f"(its model.* keys, data.vocab_size and the tokenizer it was trained with)")
    teacher.requires_grad_(False)
    return teacher.eval()


def teacher_state_for(student: nn.Module, teacher: nn.Module) -> dict[str, torch.Tensor]:
    """The teacher's state dict, with a key/value projection of Hkv grouped heads repeated to the student's
    H heads where the student's mixer has one per query head (GDN), as GQA shares them: head h reads group
    h // (H / Hkv) (Mamba-in-the-Llama initialises its state-space layers from attention so)."""
    state = teacher.state_dict()
    own = student.state_dict()
    head_dim = teacher.config.head_dim
    for name, w in state.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")) and name in own and own[name].shape != w.shape:
            groups, heads = w.shape[0] // head_dim, own[name].shape[0] // head_dim
            if own[name].shape[1:] == w.shape[1:] and own[name].shape[0] % head_dim == 0 and heads % groups == 0:
                state[name] = w.view(groups, head_dim, -1).repeat_interleave(heads // groups, 0).flatten(0, 1)
    return state


# the student beside its teacher ----------------------------------------------------------------------
@contextmanager
def mixer_io(model: nn.Module):
    """Records, per layer, what each mixer of `model` takes and gives in a forward: {layer: (x, segments, y)}
    (Block calls mixer(norm(x), cache, aux, segments))."""
    seen: dict[int, tuple] = {}
    hooks = [block.mixer.register_forward_hook(
        lambda module, args, y, i=i: seen.__setitem__(i, (args[0], args[3] if len(args) > 3 else None, y)))
        for i, block in enumerate(model.layers)]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def distill_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
               temperature: float) -> torch.Tensor:
    """T^2 mean over the tokens with a target (targets != -100) of KL(p_t || p_s), p = softmax(z / T), in fp32 at
    least (the T^2 keeps the gradient's scale as T changes: Hinton et al. 2015)."""
    keep = targets.flatten() != -100
    s = F.log_softmax(at_least_fp32(student_logits).flatten(0, -2)[keep] / temperature, -1)
    t = F.log_softmax(at_least_fp32(teacher_logits).flatten(0, -2)[keep] / temperature, -1)
    return temperature ** 2 * F.kl_div(s, t, log_target=True, reduction="batchmean")


def transfer_loss(y_student: torch.Tensor, y_teacher: torch.Tensor, kind: str) -> torch.Tensor:
    """mse: mean (y_s - y_t)^2; relative: sum (y_s - y_t)^2 / sum y_t^2 (in fp32 at least)."""
    diff = at_least_fp32(y_student) - at_least_fp32(y_teacher)
    if kind == "mse":
        return diff.pow(2).mean()
    return diff.pow(2).sum() / at_least_fp32(y_teacher).pow(2).sum()


class Linearization(nn.Module):
    """The student (a DecoderLM, this module's only submodule) beside a frozen teacher, which is held
    outside the module tree. `stage` (set_stage) picks what forward computes; it returns the student's
    LMOutput with the stage's loss as `loss`, the student's LM loss as `lm_loss` in every stage (under
    no_grad in transfer), and the stage's metrics under linearize/."""

    def __init__(self, student: nn.Module, teacher: nn.Module, lc, new_parameters: list[str]):
        super().__init__()
        self.student = student
        self._teacher = (teacher,)  # a tuple: not a submodule
        self.lc = lc
        self.stage = None
        self.linearized = [i for i, kind in enumerate(student.config.layer_mixers) if kind != TEACHER_MIXER]
        if lc.transfer_steps and not self.linearized:
            raise ValueError(f"linearize.transfer_steps={lc.transfer_steps}, but every student layer is {TEACHER_MIXER}, "
                             "as the teacher's; valid: 0, or a student with other mixers (mixer=derived_gdn, or "
                             "'model.mixer=[...]')")
        self.trainable = {name for name, p in student.named_parameters() if p.requires_grad}
        self.transfer_parameters, self.fallback_layers = self.pick_transfer_parameters(new_parameters)

    @property
    def teacher(self) -> nn.Module:
        return self._teacher[0]

    def pick_transfer_parameters(self, new: list[str]) -> tuple[list[str], list[int]]:
        """The student parameters the transfer stage trains, and the layers that add none of their own:
        transfer_trains=new: each linearized mixer's parameters that the teacher lacked (gates, convs, norms),
        or, in a mixer that adds none (derived_gdn, linear), all of its own (the q, k, v, o projections
        its linearized core reads); transfer_trains=mixer: every parameter of each linearized mixer."""
        chosen, fallback = [], []
        for i in self.linearized:
            prefix = f"layers.{i}.mixer."
            own = [n for n in self.trainable if n.startswith(prefix)]
            added = [n for n in own if n in new]
            if self.lc.transfer_trains == "new" and not added:
                fallback.append(i)
            chosen += added if self.lc.transfer_trains == "new" and added else own
        return sorted(chosen), fallback

    def set_stage(self, stage: str) -> None:
        """transfer: only transfer_parameters require gradients; distill, finetune: every parameter the run
        trains (trainer.trainable). The others' gradients stay None."""
        if stage == self.stage:
            return
        train = set(self.transfer_parameters) if stage == "transfer" else self.trainable
        for name, p in self.student.named_parameters():
            p.requires_grad_(name in train)
        self.stage = stage

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> LMOutput:
        stage_metric = {"linearize/stage": torch.tensor(float(STAGES.index(self.stage)), device=input_ids.device)}
        if self.stage == "transfer":
            return self.transfer(input_ids, labels, position_ids, stage_metric)
        out = self.student(input_ids, labels=labels, position_ids=position_ids)
        if self.stage == "distill":
            with torch.no_grad():
                teacher_logits = self.teacher(input_ids, position_ids=position_ids).logits
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
            kl = distill_kl(out.logits, teacher_logits, targets, self.lc.temperature)
            out.loss = kl + self.lc.ce_weight * out.lm_loss + (0 if out.aux_loss is None else out.aux_loss)
            stage_metric["linearize/distill/kl"] = kl.detach()
        out.aux_metrics = {**out.aux_metrics, **stage_metric}
        return out

    def transfer(self, input_ids, labels, position_ids, metrics: dict) -> LMOutput:
        with torch.no_grad(), mixer_io(self.teacher) as teacher_io:
            self.teacher(input_ids, position_ids=position_ids, logits_to_keep=1)
        with torch.no_grad():
            out = self.student(input_ids, labels=labels, position_ids=position_ids)
        total, errors = 0.0, []
        for i, block in enumerate(self.student.layers):
            x, segments, y_teacher = teacher_io[i]
            y = block.mixer(x, None, AuxCollector(), segments)  # a mixer's own aux losses have no part here
            total = total + transfer_loss(y, y_teacher, self.lc.transfer_loss)
            error = ((at_least_fp32(y) - at_least_fp32(y_teacher)).norm() / at_least_fp32(y_teacher).norm()).detach()
            metrics[f"linearize/transfer/layer{i}/rel_error"] = error
            errors.append(error)
        metrics["linearize/transfer/loss"] = total.detach()
        metrics["linearize/transfer/rel_error"] = torch.stack([errors[i] for i in self.linearized] or errors).mean()
        return LMOutput(loss=total, logits=out.logits, lm_loss=out.lm_loss, aux_loss=None,
                        aux_metrics={**out.aux_metrics, **metrics})

    def flops_per_token(self, stage: str, seq_len: int, device) -> float:
        """Training FLOPs per token of a step in `stage` (training/budget.py part_costs, the student's parts 3x
        where the stage trains any of their own parameters, 1x where it trains none). transfer: the teacher's
        forward (its lm_head on one token), the student's forward under no_grad, and every student mixer run
        again on the teacher's mixer input; distill: the teacher's forward beside the student's step; finetune:
        the student's step."""
        from training.budget import part_costs

        names = set(self.transfer_parameters) if stage == "transfer" else self.trainable
        chosen = {id(p) for name, p in self.student.named_parameters() if name in names}
        student = part_costs(self.student, seq_len, device, lambda p: id(p) in chosen)
        teacher = self.teacher.flops_by_part(seq_len, device)
        if stage == "transfer":
            teacher_forward = sum(teacher.values()) - teacher["lm_head"] * (1 - 1 / seq_len)
            mixers = sum(cost for part, cost in student.items() if part.split(".")[2:3] == ["mixer"])
            return teacher_forward + self.student.flops_per_token(seq_len, device) + mixers
        return sum(student.values()) + (sum(teacher.values()) if stage == "distill" else 0)

    def describe(self, max_steps: int) -> str:
        """The stage plan, for the run's first lines."""
        lc, names = self.lc, self.transfer_parameters
        parts = []
        if lc.transfer_steps:
            layers = f"layers {self.linearized}" if self.linearized else "no layer"
            count = sum(p.numel() for n, p in self.student.named_parameters() if n in set(names))
            trains = f"{len(names)} tensors, {count / 1e6:.3f}M parameters"
            if self.fallback_layers:
                trains += (f"; the mixers of layers {self.fallback_layers} add no parameters to the teacher's, so "
                           "their own (q/k/v/o projections) train")
            parts.append(f"transfer steps 1-{lc.transfer_steps} on {layers} ({lc.transfer_loss}; trains {trains})")
        if lc.distill_steps:
            first = lc.transfer_steps + 1
            parts.append(f"distill steps {first}-{first + lc.distill_steps - 1} (T={lc.temperature:g}, "
                         f"ce_weight={lc.ce_weight:g})")
        first = lc.transfer_steps + lc.distill_steps + 1
        parts.append(f"finetune steps {first}-{max_steps}" if first <= max_steps else "no finetune")
        return "linearize: " + "; ".join(parts)


@OBJECTIVES.register("linearize")
class Linearize(Objective):
    """The student beside its teacher (Linearization), in the stage of each step; the student as it starts
    (the teacher's weights, its own mixers) is evaluated before the first step. Without a transfer or distill
    stage no teacher is loaded: the run fine-tunes init_from as objective=lm does."""

    def __init__(self, cfg, lm: nn.Module, state):
        from accelerate.utils import DistributedType

        self.lc, self.teacher, self.linearization = cfg.linearize, None, None
        if uses_teacher(self.lc):
            if state.distributed_type == DistributedType.FSDP:
                raise ValueError("objective=linearize with FSDP: not supported yet (the transfer stage calls each layer's "
                                 "mixer outside its FSDP unit; use DDP)")
            self.teacher = load_teacher(cfg.init_from, lm.config)
        super().__init__(cfg, lm, state)
        if self.teacher is not None:
            self.linearization = Linearization(lm, self.teacher.to(state.device), self.lc, self.new_parameters)

    def initial_weights(self):
        return self.cfg.init_from if self.teacher is None else teacher_state_for(self.lm, self.teacher)

    @property
    def module(self) -> nn.Module:
        return self.lm if self.linearization is None else self.linearization

    @property
    def evaluates_at_start(self) -> bool:
        return self.linearization is not None

    @property
    def leaves_parameters_unused(self) -> bool:  # the stages train different sets
        return self.linearization is not None or super().leaves_parameters_unused

    def begin_step(self, step: int) -> None:
        if self.linearization is not None:
            self.linearization.set_stage(stage_at(step, self.lc))

    def phase_ends(self, max_steps: int) -> dict[int, str]:
        return stage_ends(self.lc, max_steps) if self.linearization is not None else {}

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
