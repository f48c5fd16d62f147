"""The linearize teacher: loading the frozen softmax teacher (checked against the student), the state dict the
student starts from, and which student layers stay softmax (keep_softmax, and the KL scores auto:<m> picks by)."""
import re
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.registry import MIXERS
from training.objectives.linearize.losses import distill_kl

TEACHER_MIXER = "softmax"
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
