"""Which training sequences make up each optimizer step."""
import torch


def global_batch(step: int, num_blocks: int, batch_size: int, seed: int) -> torch.Tensor:
    """Indices of the sequences of optimizer step `step`: epoch-wise seeded permutations, so the data
    position is the step itself (resume and any process count see the same batches)."""
    per_epoch = num_blocks // batch_size
    if per_epoch == 0:
        raise ValueError(f"trainer.batch_size={batch_size} exceeds the {num_blocks} training sequences")
    epoch, pos = divmod(step, per_epoch)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return perm[pos * batch_size:(pos + 1) * batch_size]


def micro_batches(indices: torch.Tensor, grad_accum: int, rank: int, world: int) -> list[torch.Tensor]:
    """This process's micro-batches of one step: the global batch is cut into grad_accum x world
    equal slices, micro-step-major, so P processes x A micro-steps cover the same sequences for
    every split of P x A."""
    micro = indices.numel() // (grad_accum * world)
    return [indices[(m * world + rank) * micro:(m * world + rank + 1) * micro] for m in range(grad_accum)]
