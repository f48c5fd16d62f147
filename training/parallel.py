"""Expert parallelism in training: `trainer.expert_parallel=N` splits every MoE layer's routed experts
over N processes (model/ffn/expert_parallel.py moves the rows), composed with data parallelism on a
2-D device mesh (dp x ep) of the W = dp N processes.

- Each process holds its E / N experts as ordinary parameters of the same names (ep rank r: experts
  [r E/N, (r + 1) E/N)), cut from the full, identically seeded init; the router, the shared experts and
  every other parameter stay replicated and are averaged by DDP as usual.
- DDP skips the expert parameters (they differ across the ep ranks). After the backward, an expert
  shard's gradient holds the sum over its ep group's tokens; it is summed over the data replicas of the
  same shard (the dp group) and divided by W, which gives the mean over all processes that DDP gives the
  replicated parameters: the step equals one process with accumulation.
- The gradient norm adds the shards' squares over the ep group to the replicated part's.
- Checkpoints and the export see DTensors: each shard is DTensor.from_local on the mesh with
  placements (Replicate over dp, Shard(0) over ep), so DCP writes each shard once and reshards on load
  (a run saved with EP 2 resumes with EP 1 or on another layout), and the export gathers every expert.
Why the parameters are not DTensors themselves: DDP and the optimizers' foreach steps (AdamW, Muon's
per-expert views) take plain tensors; a plain shard plus a DTensor view at the boundaries keeps them
as they are. Not yet: FSDP2 + EP (setup refuses it).
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from model.ffn.expert_parallel import ExpertParallel
from model.ffn.moe import MoE

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
EXPERT_PLACEMENTS = (Replicate(), Shard(0))  # an expert shard on the (dp, ep) mesh


def apply_expert_parallel(lm, size: int, world: int, device_type: str):
    """Split every MoE layer's experts over `size` ranks of a (world / size, size) mesh; returns the
    mesh (None for size 1). A size that does not fit is a one-line error."""
    if size == 1:
        return None
    if world % size:
        raise ValueError(f"trainer.expert_parallel={size}; valid: a divisor of the process count ({world})")
    moes = [m for m in lm.modules() if isinstance(m, MoE)]
    if not moes:
        raise ValueError(f"trainer.expert_parallel={size} needs MoE layers (ffn=moe or an moe in model.ffn)")
    if bad := next((m for m in moes if m.num_experts % size), None):
        raise ValueError(f"trainer.expert_parallel={size}; valid: a divisor of ffn.options.num_experts={bad.num_experts}")
    mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("dp", "ep"))
    for moe in moes:
        moe.shard_experts(ExpertParallel(mesh["ep"].get_group(), moe.num_experts))
    lm._ddp_params_and_buffers_to_ignore = expert_parameter_names(lm)  # DDP must not average them
    return mesh


def expert_parameter_names(lm) -> list[str]:
    return [f"{name}.{w}" for name, m in lm.named_modules() if isinstance(m, MoE) and m.expert_parallel
            for w in EXPERT_WEIGHTS]


def expert_parameters(lm) -> list[torch.Tensor]:
    return [getattr(m, w) for m in lm.modules() if isinstance(m, MoE) and m.expert_parallel for w in EXPERT_WEIGHTS]


def reduce_and_clip_gradients(lm, mesh, max_norm: float | None) -> float:
    """After the backward (DDP has averaged the replicated gradients): each expert shard's gradient
    summed over the dp group and divided by the process count, then every gradient clipped to
    max_norm with that norm (torch's clip_grads_with_norm_). Returns the norm before clipping."""
    experts = expert_parameters(lm)
    ids = {id(p) for p in experts}
    for p in experts:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in experts]
    flat = torch.cat([g.flatten() for g in grads])
    if mesh["dp"].size() > 1:
        dist.all_reduce(flat, group=mesh["dp"].get_group())
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    replicated = [p for p in lm.parameters() if p.grad is not None and id(p) not in ids]
    expert_sq = flat.double().square().sum()
    dist.all_reduce(expert_sq, group=mesh["ep"].get_group())
    norm = (expert_sq + sum(p.grad.double().square().sum() for p in replicated)).sqrt()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(experts + replicated, max_norm, norm)
    return norm.item()


def step_metrics(lm, device) -> dict:
    """The exchange telemetry of the training forwards and backwards since the last call, summed over
    the MoE layers (a step's worth), then reset: ep/a2a_seconds, ep/a2a_bytes (sent by this process),
    ep/rows_sent, and ep/received_imbalance (max / mean rows received per rank, mean over forwards)."""
    totals = {}
    for m in lm.modules():
        if isinstance(m, MoE) and m.expert_parallel:
            for k, v in m.expert_parallel.stats.items():
                if not k.startswith("_"):
                    totals[k] = totals.get(k, 0.0) + v
            m.expert_parallel.stats = {k: v for k, v in m.expert_parallel.stats.items() if k.startswith("_")}
    if not totals.get("forwards"):
        return {}
    out = {f"ep/a2a_{k}": totals[k] for k in ("seconds", "bytes")}
    out["ep/rows_sent"] = totals["rows_sent"]
    out["ep/received_imbalance"] = totals["received_imbalance"] / totals["forwards"]
    return {k: torch.tensor(v, device=device) for k, v in out.items()}


def as_dtensors(state: dict, lm, mesh) -> dict:
    """The model and optimizer state dicts (get_state_dict's FQN form) with every expert shard, and
    every optimizer state of the shard's shape, as a DTensor view on the mesh (no copy)."""
    for name in expert_parameter_names(lm):
        shape = state["model"][name].shape
        state["model"][name] = DTensor.from_local(state["model"][name], mesh, EXPERT_PLACEMENTS, run_check=False)
        if name in state["optim"].get("state", {}):  # a new dict: the old one may be the optimizer's own
            state["optim"]["state"][name] = {
                key: DTensor.from_local(value, mesh, EXPERT_PLACEMENTS, run_check=False)
                if torch.is_tensor(value) and value.shape == shape else value
                for key, value in state["optim"]["state"][name].items()}
    return state


def as_local(state: dict) -> dict:
    """as_dtensors undone: each DTensor back to this rank's shard."""
    def local(value):
        return value.to_local() if isinstance(value, DTensor) else value

    state["model"] = {k: local(v) for k, v in state["model"].items()}
    for name, entries in state["optim"].get("state", {}).items():
        state["optim"]["state"][name] = {k: local(v) for k, v in entries.items()}
    return state


def full_experts(full_state: dict, lm, mesh) -> dict:
    """A full model state dict (every rank calls it: it gathers) with each expert shard replaced by all
    E experts."""
    for name in expert_parameter_names(lm):
        shard = lm.get_parameter(name).detach()
        full_state[name] = DTensor.from_local(shard, mesh, EXPERT_PLACEMENTS, run_check=False).full_tensor().cpu()
    return full_state
