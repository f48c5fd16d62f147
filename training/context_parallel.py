"""Context parallelism in training: `trainer.context_parallel=N` splits every training and validation sequence
over N processes, composed with data parallelism on a 2-D device mesh (dp x cp) of the W = dp N processes
(rank = dp_rank N + cp_rank: a context group is N consecutive ranks, on one node where they fit).

- Every rank of a context group reads its data replica's micro-batches (whole rows), and the model runs this
  rank's slice of every row (DecoderLM.forward's `context`): rank r holds tokens [r T/N, (r + 1) T/N). Each
  mixer exchanges what its math needs with the other ranks of its group (model/ops/context_parallel.py and
  each op's *_cp form): the recurrent mixers a state map per slice, the short convolutions a halo, softmax the
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
from torch.distributed.device_mesh import init_device_mesh

from model.layers import ShortConv
from model.ops.context_parallel import ContextGroup
from model.registry import MIXERS


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


def step_metrics(context: ContextGroup | None, device) -> dict:
    """cp/bytes: what this process sent to its context group in the training forwards and backwards since the last
    call (a step's worth: every exchange, both ways), and cp/bytes_<kind> per kind of exchange; then reset."""
    if context is None:
        return {}
    sent = context.take_sent()
    out = {"cp/bytes": sum(sent.values()), **{f"cp/bytes_{kind}": value for kind, value in sent.items()}}
    return {k: torch.tensor(v, device=device) for k, v in out.items()}
