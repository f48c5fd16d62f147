"""What the linearize stages fit: the records of each mixer's input, output and core (the input of its output
projection) in a forward, the transfer stage's loss on them, and the distill stage's KL on the logits."""
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.layers import at_least_fp32


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
