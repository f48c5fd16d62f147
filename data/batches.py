"""Which training sequences make up each optimizer step.

The order is a pure function of (seed, step): resume and any process count see the same batches.
Each epoch visits every block once in the order of a keyed pseudo-random permutation of
[0, num_blocks) that is evaluated only at the indices a step needs (a Feistel network on the next
power of four, cycle-walking back into range), so a step costs O(batch_size) whatever the corpus size.
"""
import numpy as np
import torch

ROUNDS = 4
MIX = np.uint64(0x9E3779B97F4A7C15)


def _round(half: np.ndarray, key: np.uint64, mask: np.uint64) -> np.ndarray:
    """A keyed mix of one Feistel half (a splitmix64-style multiply / xor-shift), cut to `mask`."""
    z = (half ^ key) * MIX
    z ^= z >> np.uint64(29)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(32)
    return z & mask


def permute(indices: np.ndarray, n: int, key: int) -> np.ndarray:
    """The images of `indices` (in [0, n)) under the permutation of [0, n) keyed by `key`."""
    bits = max(2, int(n - 1).bit_length() + (int(n - 1).bit_length() & 1))  # even, 2^bits >= n
    h = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    keys = [np.uint64((key * 0x2545F4914F6CDD1D + r * 0x632BE59BD9B4E019) % (1 << 64)) for r in range(ROUNDS)]

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> h, x & mask
        for k in keys:
            left, right = right, left ^ _round(right, k, mask)
        return (left << h) | right

    with np.errstate(over="ignore"):
        y = feistel(np.asarray(indices, dtype=np.uint64))
        outside = y >= n
        while outside.any():  # cycle-walking: a bijection of [0, 4^k) restricted to [0, n) stays one
            y[outside] = feistel(y[outside])
            outside = y >= n
    return y.astype(np.int64)


def global_batch(step: int, num_blocks: int, batch_size: int, seed: int) -> torch.Tensor:
    """Indices of the sequences of optimizer step `step`: epoch e visits the blocks in the order of
    the permutation keyed by (seed, e); a remainder of fewer than batch_size blocks is skipped."""
    per_epoch = num_blocks // batch_size
    if per_epoch == 0:
        raise ValueError(f"trainer.batch_size={batch_size} exceeds the {num_blocks} training sequences")
    epoch, pos = divmod(step, per_epoch)
    positions = np.arange(pos * batch_size, (pos + 1) * batch_size, dtype=np.int64)
    return torch.from_numpy(permute(positions, num_blocks, seed * 1_000_003 + epoch))


def micro_batches(indices: torch.Tensor, grad_accum: int, rank: int, world: int) -> list[torch.Tensor]:
    """This process's micro-batches of one step: the global batch is cut into grad_accum x world
    equal slices, micro-step-major, so P processes x A micro-steps cover the same sequences for
    every split of P x A."""
    micro = indices.numel() // (grad_accum * world)
    return [indices[(m * world + rank) * micro:(m * world + rank + 1) * micro] for m in range(grad_accum)]
