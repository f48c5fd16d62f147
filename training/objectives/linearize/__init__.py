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
"""
import copy
import re
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf

from model.layers import AuxCollector, at_least_fp32
from model.lm import LMOutput
from model.registry import MIXERS
from training.objectives import OBJECTIVES, Objective

STAGES = ("transfer", "distill", "finetune")
TEACHER_MIXER = "softmax"
TRANSFER_TARGETS = ("mixer_core", "output")  # the input of the mixer's output projection | the mixer's output


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


# which layers stay softmax ---------------------------------------------------------------------------
def parse_keep_softmax(value, layer_mixers: list[str]) -> list[int] | int | None:
    """linearize.keep_softmax: null -> None; a list of layer indices -> that list; auto:<m> -> m, at least 1 and
    at most the student's linearized (non-softmax) layers. Anything else is one line."""
    linearized = sum(kind != TEACHER_MIXER for kind in layer_mixers)
    L = len(layer_mixers)
    valid = (f"null, a list of layer indices in 0..{L - 1}, or auto:<m> with 1 <= m <= {linearized} (the student's "
             "non-softmax layers)")
    if value is None:
        return None
    if isinstance(value, str):
        match = re.fullmatch(r"auto:(\d+)", value)
        if match and 1 <= int(match.group(1)) <= linearized:
            return int(match.group(1))
    elif not isinstance(value, (str, bool)) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < L
                                                    for i in value):
        return sorted(set(value))
    shown = value if isinstance(value, str) else list(value) if not isinstance(value, bool) else value
    raise ValueError(f"linearize.keep_softmax={shown}; valid: {valid}")


def with_softmax_layers(lm: nn.Module, layers: list[int]) -> None:
    """The student with the mixers of `layers` replaced by softmax attention (at its init: the teacher's weights
    load over it), its config saying so."""
    kinds = lm.config.layer_mixers
    for i in layers:
        if kinds[i] != TEACHER_MIXER:
            mixer = MIXERS.get(TEACHER_MIXER)(lm.config, i)
            mixer.init_parameters()
            lm.layers[i].mixer = mixer.to(next(lm.parameters()).device)
            kinds[i] = TEACHER_MIXER
    lm.config.mixer = kinds


@contextmanager
def restored_to_softmax(student: nn.Module, teacher: nn.Module, layer: int):
    """The student with its layer-`layer` mixer swapped for the teacher's own attention, for the context."""
    block = student.layers[layer]
    own = block.mixer
    block.mixer = teacher.layers[layer].mixer
    try:
        yield student
    finally:
        block.mixer = own


@torch.no_grad()
def kl_with_each_layer_softmax(student: nn.Module, teacher: nn.Module, batches: list[dict],
                               layers: list[int]) -> tuple[float, dict[int, float]]:
    """(KL(p_teacher || p_student) per predicted token over the batches, at T = 1, of the student as it is;
    {layer: the same KL with that layer restored to the teacher's attention})."""
    totals, tokens = {None: 0.0, **{i: 0.0 for i in layers}}, 0
    for batch in batches:
        ids, position_ids = batch["input_ids"], batch.get("position_ids")
        targets = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        count = int((targets != -100).sum())
        teacher_logits = teacher(ids, position_ids=position_ids).logits
        for i in totals:
            if i is None:
                logits = student(ids, position_ids=position_ids).logits
            else:
                with restored_to_softmax(student, teacher, i) as hybrid:
                    logits = hybrid(ids, position_ids=position_ids).logits
            totals[i] += distill_kl(logits, teacher_logits, targets, 1.0).item() * count
        tokens += count
    return totals.pop(None) / tokens, {i: total / tokens for i, total in totals.items()}


# the teacher and the student's start ----------------------------------------------------------------
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim")


def load_teacher(path: str, student_config) -> nn.Module:
    """The frozen teacher at `path` (HF dir, run dir or checkpoint), checked against the student: every
    layer softmax attention, and the student's shape. A mismatch is one line naming what differs."""
    from runs.checkpoint import load_lm

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
def mixer_cores(mixers: list[nn.Module]):
    """Records what each mixer's output projection (its `output_projection`: y = W c) takes in a forward, the
    mixer's core c: {index in `mixers`: c}."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [getattr(mixer, mixer.output_projection).register_forward_pre_hook(
        lambda module, args, i=i: seen.__setitem__(i, args[0])) for i, mixer in enumerate(mixers)]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


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


@OBJECTIVES.register("linearize")
class Linearize(Objective):
    """The student beside its teacher (Linearization), in the stage of each step; the student as it starts
    (the teacher's weights, its own mixers) is evaluated before the first step. Without a transfer or distill
    stage no teacher is loaded: the run fine-tunes init_from as objective=lm does. keep_softmax makes the
    student's named layers softmax, or (auto:<m>) the m its selection picks (select_layers)."""

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
    def leaves_parameters_unused(self) -> bool:  # the stages train different sets
        return self.linearization is not None or super().leaves_parameters_unused

    def begin_step(self, step: int) -> None:
        if self.linearization is not None:
            self.linearization.set_stage(stage_at(step, self.linearization.plan))

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
