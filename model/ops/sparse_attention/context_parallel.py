"""DSA's context-parallel form (the mixer: model/mixers/dsa.py; the exchanges: model/ops/context_parallel.py): only
the keys and values the top-k selection needs travel.

The lightning indexer scores every key up to the slice's end (its keys, d_I numbers per token, are all-gathered)
and picks each query's top-k as one process would. `fetch_selected` then asks each earlier rank for the rows of
keys and values that some query of this slice selected (each such key once), and lays them out as a compact key
table per row: the fetched keys in order, then this rank's own L. The selection is renumbered into it, which
keeps its order (a query still sits after every key it may see), so the sparse attention ops run on it
unchanged."""
import torch

from model.ops.context_parallel import ContextGroup


def fetch_selected(indices: torch.Tensor, local: torch.Tensor, context: ContextGroup, start: int, length: int):
    """indices [B, L, K]: each of this rank's queries' selected keys, as positions in the whole rows of `length`
    tokens (-1: an empty slot); local [B, L, *]: this rank's rows of what to fetch (keys and values side by side);
    start: its slice's first position. Returns (table [B, F + L, *], the selection in the table's positions
    [B, L, K], positions [B, F + L] of the table's keys in the whole rows (pad slots: 0)): F, the most keys a row
    fetched, holds each row's fetched keys in order, then zero padding no query selects."""
    B, L = local.shape[:2]
    remote = indices[(indices >= 0) & (indices < start)]
    rows = torch.arange(B, device=indices.device)[:, None, None].expand_as(indices)[(indices >= 0) & (indices < start)]
    keys = torch.unique(rows * length + remote)  # each fetched (row, position) once, sorted by row, then position
    row, position = keys // length, keys % length
    owner = position // L
    by_owner = torch.argsort(owner * B * length + keys)  # rank, then row, then position
    wanted = [(row * L + position - owner * L)[by_owner][owner[by_owner] == s] for s in range(context.size)]
    fetched = context.fetch(local.flatten(0, 1), wanted)  # in by_owner's order
    counts = torch.bincount(row, minlength=B)
    F = int(counts.max()) if len(keys) else 0
    slot = torch.arange(len(keys), device=keys.device) - (counts.cumsum(0) - counts)[row]  # place in its row's list
    table = local.new_zeros(B, F, *local.shape[2:]).index_put((row[by_owner], slot[by_owner]), fetched)
    table = torch.cat([table, local], 1)
    positions = torch.zeros(B, F, dtype=torch.long, device=indices.device).index_put_((row, slot), position)
    positions = torch.cat([positions, torch.arange(start, start + L, device=indices.device).expand(B, L)], 1)
    b = torch.arange(B, device=indices.device)[:, None, None]
    earlier = (indices >= 0) & (indices < start)
    at = torch.searchsorted(keys, (b * length + indices.clamp(min=0)).flatten()).view_as(indices).clamp(max=max(len(keys) - 1, 0))
    renumbered = torch.where(earlier, slot[at] if len(keys) else indices, F + indices - start)
    return table, torch.where(indices >= 0, renumbered, -1), positions
