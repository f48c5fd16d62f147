"""Linearization: the student beside its frozen teacher, computing the loss of the stage it is in."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf

from model.layers import AuxCollector, at_least_fp32
from model.lm import LMOutput
from training.objectives.linearize.losses import distill_kl, mixer_cores, mixer_io, transfer_loss
from training.objectives.linearize.teacher import TEACHER_MIXER


STAGES = ("transfer", "distill", "finetune")


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
        if lc.transfer_target == "mixer_core":
            self.check_cores(new_parameters)
        self.transfer_parameters, self.fallback_layers = self.pick_transfer_parameters(new_parameters)
        # the stages as they run: a transfer stage with nothing to train is skipped, its steps going to the next
        self.plan = OmegaConf.merge(lc, {"transfer_steps": lc.transfer_steps if self.transfer_parameters else 0})

    @property
    def teacher(self) -> nn.Module:
        return self._teacher[0]

    def output_projection(self, layer: int) -> str:
        """The student's layer-`layer` output projection, as a parameter-name prefix."""
        return f"layers.{layer}.mixer.{self.student.layers[layer].mixer.output_projection}."

    def check_cores(self, new: list[str]) -> None:
        """transfer_target=mixer_core fits each core before the teacher's own o_proj: every linearized mixer's output
        projection must be the teacher's (loaded, not new), else one line."""
        for i in self.linearized:
            name, mixer, theirs = self.output_projection(i), self.student.layers[i].mixer, self.teacher.layers[i].mixer
            own = getattr(mixer, mixer.output_projection).weight
            if any(n.startswith(name) for n in new) or own.shape != getattr(theirs, theirs.output_projection).weight.shape:
                raise ValueError(
                    f"linearize.transfer_target=mixer_core, but layer {i}'s {type(mixer).__name__} output projection "
                    f"{name[:-1]} is not the teacher's o_proj (new, or of another shape); valid: output, or a student "
                    "whose output projection loads the teacher's (gdn: mixer.options.expand_v=1)")

    def pick_transfer_parameters(self, new: list[str]) -> tuple[list[str], list[int]]:
        """The student parameters the transfer stage trains, and the layers whose own train for want of new ones:
        transfer_trains=new: each linearized mixer's parameters that the teacher lacked (gates, convs, norms);
        with transfer_target=output, a mixer that adds none (derived_gdn, linear) trains all of its own (the q, k,
        v, o projections its linearized core reads), with mixer_core nothing (LoLCATs keeps q, k, v, o frozen).
        transfer_trains=mixer: every parameter of each linearized mixer (with mixer_core but its output projection,
        which the loss does not reach)."""
        chosen, fallback = [], []
        core = self.lc.transfer_target == "mixer_core"
        for i in self.linearized:
            prefix = f"layers.{i}.mixer."
            own = [n for n in self.trainable if n.startswith(prefix)
                   and not (core and n.startswith(self.output_projection(i)))]
            added = [n for n in own if n in new]
            if self.lc.transfer_trains == "new" and not added and not core:
                fallback.append(i)
            chosen += added if self.lc.transfer_trains == "new" and (added or core) else own
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
        core = self.lc.transfer_target == "mixer_core"
        with (torch.no_grad(), mixer_io(self.teacher) as teacher_io,
              mixer_cores([block.mixer for block in self.teacher.layers]) as teacher_cores):
            self.teacher(input_ids, position_ids=position_ids, logits_to_keep=1)
        with torch.no_grad():
            out = self.student(input_ids, labels=labels, position_ids=position_ids)
        total, errors = 0.0, []
        for i, block in enumerate(self.student.layers):
            x, segments, y_teacher = teacher_io[i]
            with mixer_cores([block.mixer]) as cores:
                y = block.mixer(x, None, AuxCollector(), segments)  # a mixer's own aux losses have no part here
            if core:  # before o_proj: the output projections stay out of the fit
                y, y_teacher = cores[0], teacher_cores[i]
            total = total + transfer_loss(y, y_teacher, self.lc.transfer_loss)
            error = ((at_least_fp32(y) - at_least_fp32(y_teacher)).norm() / at_least_fp32(y_teacher).norm()).detach()
            metrics[f"linearize/transfer/layer{i}/rel_error"] = error
            errors.append(error)
        metrics["linearize/transfer/loss"] = total.detach()
        metrics["linearize/transfer/rel_error"] = torch.stack([errors[i] for i in self.linearized] or errors).mean()
        return LMOutput(loss=total, logits=out.logits, lm_loss=out.lm_loss, aux_loss=None,
                        aux_metrics={**out.aux_metrics, **metrics})

    def flops_per_token(self, stage: str, seq_len: int, device) -> float:
        """Training FLOPs per token of a step in `stage` (runs/flops.py part_costs, the student's parts 3x
        where the stage trains any of their own parameters, 1x where it trains none). transfer: the teacher's
        forward (its lm_head on one token), the student's forward under no_grad, and every student mixer run
        again on the teacher's mixer input; distill: the teacher's forward beside the student's step; finetune:
        the student's step."""
        from runs.flops import part_costs

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
        lc, names = self.plan, self.transfer_parameters
        parts = []
        target = "the mixer core before o_proj" if lc.transfer_target == "mixer_core" else "the mixer output"
        if lc.transfer_steps:
            layers = f"layers {self.linearized}" if self.linearized else "no layer"
            count = sum(p.numel() for n, p in self.student.named_parameters() if n in set(names))
            trains = f"{len(names)} tensors, {count / 1e6:.3f}M parameters"
            if self.fallback_layers:
                trains += (f"; the mixers of layers {self.fallback_layers} add no parameters to the teacher's, so "
                           "their own (q/k/v/o projections) train")
            parts.append(f"transfer steps 1-{lc.transfer_steps} on {layers} ({lc.transfer_loss} on {target}; "
                         f"trains {trains})")
        elif self.lc.transfer_steps:
            parts.append(f"no transfer: with transfer_target=mixer_core the mixers of layers {self.linearized} have "
                         f"nothing to train (they add no parameters, and q/k/v/o stay the teacher's), so its "
                         f"{self.lc.transfer_steps} steps go to the stages after it")
        if lc.distill_steps:
            first = lc.transfer_steps + 1
            parts.append(f"distill steps {first}-{first + lc.distill_steps - 1} (T={lc.temperature:g}, "
                         f"ce_weight={lc.ce_weight:g})")
        first = lc.transfer_steps + lc.distill_steps + 1
        parts.append(f"finetune steps {first}-{max_steps}" if first <= max_steps else "no finetune")
        return "linearize: " + "; ".join(parts)
