"""AdamW with decoupled weight decay on matrices only, and the LR schedules (from transformers)."""
import torch
from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup, get_wsd_schedule

SCHEDULES = ("cosine", "wsd", "constant")
# Gate / decay parameters of the linear mixers: never decayed (they set time constants, not features).
NO_DECAY_NAMES = ("A_log", "dt_bias", "D")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay only weight matrices: no decay on norms, biases, embeddings (tied lm_head included)
    and the gate parameters A_log / dt_bias / D."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.ndim < 2 or "embed_tokens" in name or name.rsplit(".", 1)[-1] in NO_DECAY_NAMES
        (no_decay if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model, cfg) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas),
                             eps=1e-8, fused=None)


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
