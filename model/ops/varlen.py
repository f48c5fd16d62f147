"""Variable-length (packed) sequences in fla's `cu_seqlens` convention: sequences are concatenated
along time into one [1, T, ...] row, sequence i spanning tokens cu_seqlens[i]:cu_seqlens[i + 1]
(cu_seqlens [N + 1] long, 0 first and T last). The chunked ops run such a row by laying every
sequence out on whole chunks (zero-padded at its end), so each state recursion restarts at a chunk.
"""
from dataclasses import dataclass

import torch


def sequence_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] long: the index of the sequence each token belongs to."""
    lengths = cu_seqlens.diff()
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)


def positions_in_sequences(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] long: 0 at the first token of each sequence, +1 within it."""
    T = int(cu_seqlens[-1])
    return torch.arange(T, device=cu_seqlens.device) - cu_seqlens[:-1][sequence_ids(cu_seqlens)]


def sequence_cumsum(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Cumulative sum along dim 1 of x [1, T, ...] restarting at each sequence start: the running sum
    over the whole row minus its value before the sequence, in fp64 so that the difference of two
    large prefix sums keeps x's precision."""
    total = x.to(torch.float64).cumsum(1)
    before = total[:, cu_seqlens[:-1]] - x[:, cu_seqlens[:-1]].to(torch.float64)  # the sum before each sequence
    return (total - before[:, sequence_ids(cu_seqlens)]).to(x.dtype)


@dataclass
class ChunkLayout:
    """Where the tokens of a packed row go when every sequence starts on a chunk of C tokens.

    index [T]: each token's position in the padded row of `length` tokens (a multiple of C);
    resets [length / C] bool: chunk n starts a sequence (the state entering it is zero);
    ends [N] long: for sequence i, the index n of the chunk-start state S_n (S_n = the state after
    chunk n - 1) that is its final state.
    """

    index: torch.Tensor
    length: int
    resets: torch.Tensor
    ends: torch.Tensor

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, C: int) -> "ChunkLayout":
        lengths = cu_seqlens.diff()
        chunks = -(-lengths // C)  # chunks per sequence
        first_chunk = chunks.cumsum(0) - chunks
        ids = sequence_ids(cu_seqlens)
        index = first_chunk[ids] * C + positions_in_sequences(cu_seqlens)
        n = int(chunks.sum())
        resets = torch.zeros(n, dtype=torch.bool, device=cu_seqlens.device)
        resets[first_chunk] = True
        return cls(index, n * C, resets, first_chunk + chunks)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, T, ...] -> [1, length, ...], zeros between sequences."""
        return x.new_zeros(1, self.length, *x.shape[2:]).index_copy(1, self.index, x)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[1, length, ...] -> the T tokens [1, T, ...]."""
        return x.index_select(1, self.index)


def check_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, initial_state) -> None:
    """The one-line errors for a cu_seqlens call our chunked ops do not take."""
    if x.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (sequences flattened into one row), got {x.shape[0]}")
    if initial_state is not None:
        raise ValueError("cu_seqlens with an initial_state is not supported (every sequence starts from zero)")
