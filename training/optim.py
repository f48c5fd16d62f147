"""Optimizers (configs/optimizer/): AdamW, or Muon on the hidden weight matrices with AdamW on the
rest; and the LR schedules (from transformers)."""
import torch
import torch.nn as nn
from accelerate.utils import DistributedType
from torch.optim._muon import _adjust_lr
from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup, get_wsd_schedule

from common.validation import FLAG, Rule, positive

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd", "constant")
# optimizer.* of a train.py config (common/validation.py), [] standing for any index of a list
RULES = {
    "optimizer.weight_decay": Rule(float, at_least=0),
    "optimizer.momentum": Rule(float, at_least=0, below=1),
    "optimizer.nesterov": FLAG,
    "optimizer.ns_steps": positive(),
    "optimizer.betas[]": Rule(float, at_least=0, below=1),
}
# Gate / decay parameters of the linear mixers: never decayed (they set time constants, not features).
NO_DECAY_NAMES = ("A_log", "dt_bias", "D")


def param_groups(named_params, weight_decay: float, undecayed: frozenset[str] = frozenset()) -> list[dict]:
    """Decay only weight matrices: no decay on norms, biases, embeddings (tied lm_head included),
    the gate parameters A_log / dt_bias / D and the parameters their block declares (`undecayed`,
    declared_undecayed)."""
    named_params = list(named_params)
    skip = {name for name, p in named_params
            if p.ndim < 2 or "embed_tokens" in name or name.rsplit(".", 1)[-1] in NO_DECAY_NAMES}
    return decay_groups(named_params, weight_decay, skip | undecayed)


def decay_groups(named_params, weight_decay: float, undecayed: set[str]) -> list[dict]:
    """The parameters in two groups, decayed at weight_decay and (the names in `undecayed`) at 0."""
    decay = [p for name, p in named_params if name not in undecayed]
    no_decay = [p for name, p in named_params if name in undecayed]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # no empty group: DCP's optimizer state dict refuses them


def declared_undecayed(model: nn.Module) -> frozenset[str]:
    """The names of the parameters a module declares free of weight decay: a module may define
    `no_weight_decay()`, the names of its own parameters that take none (as the reinforce router's
    weight, whose decay would flatten the policy it samples from), with either optimizer."""
    return frozenset(f"{module_name}.{name}" if module_name else name for module_name, module in model.named_modules()
                     if hasattr(module, "no_weight_decay") for name in module.no_weight_decay())


def muon_split(model: nn.Module) -> tuple[list, list, list]:
    """(matrices, stacked, rest) as (name, param) lists of the trainable parameters. Muon takes the
    hidden weight matrices, those of the blocks (model.layers): nn.Linear weights (projections, gate
    projections, router) as matrices, and stacked MoE expert weights [E, in, out] (a 3-D parameter of
    a module that is not a convolution) as E matrices. AdamW takes the rest: embeddings, lm_head,
    final norm, norms, biases, conv weights and A_log / dt_bias / D (the aux-free router bias is a
    buffer, no parameter)."""
    matrices, stacked, rest = [], [], []
    for name, p in model.named_parameters():  # a tied lm_head.weight appears once, as embed_tokens.weight
        if not p.requires_grad:
            continue
        module_name, _, pname = name.rpartition(".")
        module = model.get_submodule(module_name)
        in_block = name.startswith("layers.")
        if in_block and isinstance(module, nn.Linear) and pname == "weight":
            matrices.append((name, p))
        elif in_block and p.ndim == 3 and not isinstance(module, nn.modules.conv._ConvNd):
            stacked.append((name, p))
        else:
            rest.append((name, p))
    return matrices, stacked, rest


def orthogonalize(m: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """Newton-Schulz in float32 (at least): X <- a X + (b A + c A^2) X, A = X X^T, from X = M / ||M||_F,
    on the wide orientation (Keller Jordan's quintic; torch's Muon runs the same iteration in bf16)."""
    x = m.to(torch.promote_types(m.dtype, torch.float32))
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    a, b, c = coefficients
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon that also takes stacked expert weights [E, m, n] and treats each expert's
    [m, n] slice as its own matrix (own orthogonalisation, own shape-dependent lr). torch's Muon
    accepts only 2-D parameters at construction, so the stacked ones join as a second param group
    after that check; _init_group, where torch's step collects (param, grad, momentum buffer), then
    hands the step one view per expert of each, and the in-place updates land in the stacked tensors.

    On CUDA the step is torch's (Newton-Schulz in bf16). On CPU, where bf16 matmuls without native
    support are many times slower than float32, it is the same update with Newton-Schulz in float32."""

    def __init__(self, matrices: list, stacked: list, **options):
        """matrices, stacked: parameters, or param groups (dicts) of them."""
        super().__init__(matrices, **options)
        for group in stacked if stacked and isinstance(stacked[0], dict) else [{"params": stacked}] if stacked else []:
            self.add_param_group(group)

    def _init_group(self, group, params_with_grad, grads, muon_momentum_bufs):
        start = len(params_with_grad)
        has_complex = super()._init_group(group, params_with_grad, grads, muon_momentum_bufs)
        for items in (params_with_grad, grads, muon_momentum_bufs):  # aligned: same ndim at each index
            items[start:] = [m for t in items[start:] for m in (t.unbind(0) if t.ndim == 3 else (t,))]
        return has_complex

    @torch.no_grad()
    def step(self, closure=None):
        if any(p.is_cuda for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, mu = group["lr"], group["momentum"]
            for p, g, buf in zip(params, grads, bufs):
                buf.lerp_(g, 1 - mu)
                update = g.lerp(buf, mu) if group["nesterov"] else buf
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


class CombinedOptimizer(torch.optim.Optimizer):
    """Optimizers over disjoint parameters stepped, zeroed, saved and loaded as one, so Accelerate
    prepares one optimizer and one LR scheduler drives all of them: param_groups is the list of the
    parts' own group dicts, read at each access (a part's load_state_dict replaces its dicts, e.g.
    when a checkpoint loads into the parts), and the scheduler writes each step's lr there."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts
        super().__init__([p for o in parts for g in o.param_groups for p in g["params"]], {})

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.parts for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, groups) -> None:
        """torch's __init__ assigns its own (empty) list here; the parts own the groups."""

    def add_param_group(self, param_group: dict) -> None:
        """torch's __init__ registers the parameters here; they already live in the parts' groups."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state_dict: dict) -> None:
        for part, state in zip(self.parts, state_dict["parts"], strict=True):
            part.load_state_dict(state)


def torch_optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The plain torch optimizers inside `optimizer` (a CombinedOptimizer's parts), whose state a
    checkpoint stores: torch.distributed.checkpoint maps each one's standard state dict to names."""
    return optimizer.parts if isinstance(optimizer, CombinedOptimizer) else [optimizer]


def build_optimizer(model: nn.Module, cfg, lr: float, distributed_type=DistributedType.NO) -> torch.optim.Optimizer:
    """cfg: the optimizer group (configs/optimizer/). One lr for every part: trainer.lr."""
    undecayed = declared_undecayed(model)
    if cfg.name == "adamw":
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return torch.optim.AdamW(param_groups(trainable, cfg.weight_decay, undecayed), lr=lr, betas=tuple(cfg.betas),
                                 eps=1e-8, fused=None)
    if cfg.name != "muon":
        raise ValueError(f"unknown optimizer {cfg.name!r}; valid: {', '.join(OPTIMIZERS)}")
    if distributed_type == DistributedType.FSDP:
        raise ValueError("optimizer=muon orthogonalises whole weight matrices and FSDP shards them; "
                         "use DDP (configs/accelerate/multi_gpu.yaml) or optimizer=adamw")
    matrices, stacked, rest = muon_split(model)
    # adjust_lr_fn="match_rms_adamw" (Moonlight, arXiv:2502.16982): lr x 0.2 sqrt(max(m, n)) per
    # matrix gives the update AdamW's RMS, so Muon shares AdamW's lr and weight decay.
    muon = Muon(decay_groups(matrices, cfg.weight_decay, undecayed), decay_groups(stacked, cfg.weight_decay, undecayed),
                lr=lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps,
                adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(param_groups(rest, cfg.weight_decay, undecayed), lr=lr, betas=tuple(cfg.betas), eps=1e-8, fused=None)
    return CombinedOptimizer([muon, adamw])


def build_scheduler(optimizer, cfg):
    if cfg.schedule == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, cfg.warmup_steps, cfg.max_steps, min_lr_rate=cfg.min_lr_ratio)
    if cfg.schedule == "wsd":
        decay = int(cfg.max_steps * cfg.wsd_decay_fraction)
        return get_wsd_schedule(optimizer, cfg.warmup_steps, decay, num_stable_steps=cfg.max_steps - cfg.warmup_steps - decay,
                                min_lr_ratio=cfg.min_lr_ratio, decay_type="cosine")
    if cfg.schedule == "constant":
        return get_constant_schedule_with_warmup(optimizer, cfg.warmup_steps)
    raise ValueError(f"unknown trainer.schedule {cfg.schedule!r}; valid: {', '.join(SCHEDULES)}")
