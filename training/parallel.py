"""The process mesh beyond data parallelism: expert parallelism (`trainer.expert_parallel`) and context
parallelism (`trainer.context_parallel`), each a second dimension of a 2-D device mesh with the data replicas.

## Expert parallelism
`trainer.expert_parallel=N` splits every MoE layer's routed experts
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

## Context parallelism
`trainer.context_parallel=N` splits every training and validation sequence
over N processes, composed with data parallelism on a 2-D device mesh (dp x cp) of the W = dp N processes
(rank = dp_rank N + cp_rank: a context group is N consecutive ranks, on one node where they fit).

- Every rank of a context group reads its data replica's micro-batches (whole rows), and the model runs this
  rank's slice of every row (DecoderLM.forward's `context`): rank r holds tokens [r T/N, (r + 1) T/N). Each
  mixer exchanges what its math needs with the other ranks of its group (model/ops/context_parallel.py and
  each op's context-parallel form): the recurrent mixers a state map per slice, the short convolutions a halo, softmax the
  keys and values, DSA its indexer keys and the keys and values its top-k picked.
- The loss on every rank is the whole rows' mean (the slices' sums added over the group), as are the MoE's
  balance losses and load statistics and DSA's indexer loss; so the loss and metrics logged are one
  process's. The backward gives each rank N times its share of the gradient; DDP's (or FSDP's) mean over all
  W processes turns that into the mean over data replicas: one process's step on the same global batch.
- The parameters stay replicated: checkpoints and the export are those of DDP, and a run resumes under
  another trainer.context_parallel (or process count).
- Refused in one line, naming the keys: N not dividing the process count, a length the slices cannot split
  (T not a multiple of N, or slices shorter than a short convolution's halo), a mixer that declares no
  context-parallel means (`context_exchange`), an MoE router or capacity that needs the whole batch, an
  objective other than the language model's (linearize's teacher runs whole sequences).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from model.ffn.expert_parallel import ExpertParallel
from model.ffn.moe import MoE
from model.layers import ShortConv
from model.ops.context_parallel import ContextGroup
from model.registry import MIXERS

@dataclass
class Layout:
    """This process's place in the mesh: its expert shards' mesh, its context group, the share of each global batch
    it reads, and the sequences of that share per micro-step."""
    expert_mesh: DeviceMesh | None
    context: ContextGroup | None
    share: "DataShare"
    micro: int


def micro_batch(tc, state) -> int:
    """The sequences each data replica runs per micro-step, checked before any data is prepared: the batch splits
    over the data replicas of `state`'s processes (Accelerate's PartialState) and trainer.grad_accum, else a one-line
    error; so does the process count over trainer.context_parallel, and FSDP refuses trainer.expert_parallel."""
    from accelerate.utils import DistributedType

    world = state.num_processes
    replicas = data_replicas(world, tc.context_parallel)
    micro = tc.batch_size // (replicas * tc.grad_accum)
    if micro * replicas * tc.grad_accum != tc.batch_size:
        split = f"data replicas ({replicas} = {world} processes / trainer.context_parallel={tc.context_parallel})" \
            if tc.context_parallel > 1 else f"processes ({world})"
        raise ValueError(f"trainer.batch_size={tc.batch_size} is not divisible by {split} x grad_accum ({tc.grad_accum})")
    if tc.expert_parallel > 1 and state.distributed_type == DistributedType.FSDP:
        raise ValueError(f"trainer.expert_parallel={tc.expert_parallel} with FSDP: not supported yet (use DDP)")
    return micro


def apply_parallel(lm, tc, state, device_type: str, objective: str, micro: int) -> Layout:
    """Expert and context parallelism applied to the model (trainer.expert_parallel, trainer.context_parallel) over
    the processes of `state`; a layout the model cannot take is a one-line error naming its keys."""
    world = state.num_processes
    expert_mesh = apply_expert_parallel(lm, tc.expert_parallel, world, device_type)
    context, share = apply_context_parallel(lm, tc.context_parallel, world, state.process_index, device_type,
                                            tc.seq_len, objective)
    return Layout(expert_mesh, context, share, micro)


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


def expert_metrics(lm, device) -> dict:
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


# ---- context parallelism ----
@dataclass
class DataShare:
    """Which share of each global batch this process reads: data replica `rank` of `size` (every process of a
    context group reads the same share)."""
    rank: int
    size: int


def apply_context_parallel(lm, size: int, world: int, rank: int, device_type: str, seq_len: int,
                           objective: str = "lm") -> tuple[ContextGroup | None, DataShare]:
    """This process's context group (None for size 1) on a (world / size, size) device mesh, and its data share;
    a layout that cannot work is a one-line error naming its keys (check_context_parallel)."""
    if size == 1:
        return None, DataShare(rank, world)
    check_context_parallel(lm, size, world, seq_len, objective)
    # the cp dim gets a process group of its own even where it spans every process (the device mesh would reuse
    # the default one, which DDP's gradient all-reduce shares)
    mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("dp", "cp"),
                            backend_override={"cp": dist.get_backend()})
    return ContextGroup(mesh["cp"].get_group()), DataShare(mesh["dp"].get_local_rank(), mesh["dp"].size())


def data_replicas(world: int, size: int) -> int:
    """The data replicas of `world` processes in context groups of `size`; a size that does not divide it is a
    one-line error."""
    if world % size:
        raise ValueError(f"trainer.context_parallel={size}; valid: a divisor of the process count ({world})")
    return world // size


def check_context_parallel(lm, size: int, world: int, seq_len: int, objective: str = "lm") -> None:
    key = f"trainer.context_parallel={size}"
    data_replicas(world, size)
    if seq_len % size:
        raise ValueError(f"trainer.seq_len={seq_len} with {key}; valid: a multiple of {size} (every rank holds an "
                         f"equal slice of each sequence)")
    halo = max([m.kernel_size - 1 for m in lm.modules() if isinstance(m, ShortConv)], default=0)
    if seq_len // size < halo:
        raise ValueError(f"trainer.seq_len={seq_len} with {key}: slices of {seq_len // size} tokens, shorter than a short "
                         f"convolution's halo of {halo} (mixer.options.conv_size - 1); valid: trainer.seq_len >= {halo * size}")
    declared = [name for name in MIXERS.names() if getattr(MIXERS.get(name), "context_exchange", None)]
    for kind in dict.fromkeys(lm.config.layer_mixers):
        if kind not in declared:
            raise ValueError(f"mixer={kind} with {key}: it declares no context-parallel means (context_exchange); "
                             f"valid: {', '.join(declared)}")
    for module in lm.modules():
        if (refusal := getattr(module, "refuses_context_parallel", lambda: None)()) is not None:
            option, valid = refusal
            raise ValueError(f"{option} with {key}; valid: {valid}")
    if objective != "lm":
        raise ValueError(f"objective={objective} with {key}; valid: objective=lm (the teacher and transfer stages run "
                         f"whole sequences)")


def context_metrics(context: ContextGroup | None, device) -> dict:
    """cp/bytes: what this process sent to its context group in the training forwards and backwards since the last
    call (a step's worth: every exchange, both ways), and cp/bytes_<kind> per kind of exchange; then reset."""
    if context is None:
        return {}
    sent = context.take_sent()
    out = {"cp/bytes": sum(sent.values()), **{f"cp/bytes_{kind}": value for kind, value in sent.items()}}
    return {k: torch.tensor(v, device=device) for k, v in out.items()}
