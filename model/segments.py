"""The document segments of a packed (or padded) batch: which tokens each token may see, built once per forward
and shared by every layer (model/lm.py); and continued_positions, the rotary positions of an attention mixer's
call. Under context parallelism the segments describe this rank's slice (model/ops/context_parallel.py)."""
from functools import cached_property

import torch
import torch.nn.functional as F


class DocumentSegments:
    """The document segments of a packed batch [B, T], from position_ids (0 at the first token of
    each segment, +1 within it; t = 0 always starts one, so a row may begin mid-document). Built
    once per forward and shared by all layers; each mixer reads what it needs:

    position_ids [B, T]: the rotary positions;
    cu_seqlens [S + 1]: the segments of the flattened [1, B T] row (fla's convention) for the
        recurrent ops, which restart their state at each;
    attention_mask: same-segment and causal, [B, 1, T, T] bool for SDPA on CPU, a FlexAttention
        BlockMask on CUDA;
    conv_crossings(W): the (row, token, lag) taps of a width-W causal conv that reach back across
        their token's segment start, which ShortConv subtracts.

    With a context (model/ops/context_parallel.py ContextGroup: context parallelism), position_ids are the
    whole rows' and the segments describe this rank's slice [start, end) of every row: position_ids,
    starts, cu_seqlens and the conv taps are the slice's (its first token starts a segment only where
    position_ids says so; cu_seqlens still cuts the flattened slice at each row), attention_mask [B, 1,
    L, end] covers the keys up to the slice's end, document_start the whole rows, and for the recurrent
    mixers' state passing: head [B], the leading tokens of each row that continue a segment begun on an
    earlier rank (0 where the slice starts one; always 0 on rank 0), cut [B], whether a segment starts
    inside the row's slice (its outgoing state then owes nothing to the incoming one), and last_segment
    [B], the index in cu_seqlens of each row's last segment.

    A padded batch (`padded`) is a packed one whose pads are segments of their own; `real` [B, T] then marks
    the real tokens (None without padding). A decode cache filled through segments continues each row's last
    segment: the recurrent mixers keep its final state (last_segment), ShortConv its inputs only, and the
    attention mixers its start (last_start), before which no later query looks.
    """

    @classmethod
    def padded(cls, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None) -> "DocumentSegments":
        """The segments of a padded batch (attention_mask [B, T], 1 at a real token, as tokenizers pad): each row's
        real tokens are one contiguous run, its pads on either side (left or right padding); they get positions
        0, 1, ... (rotary counts real tokens only) and the pads before and after them segments of their own, so
        that no state, conv window or attention crosses from a pad to a real token. position_ids, if given, may
        not start a document inside the real run (transformers' generate passes the real tokens' count, as here)."""
        real = attention_mask.bool()
        T = real.shape[1]
        t = torch.arange(T, device=real.device)
        first = torch.where(real, t, T).min(1, keepdim=True).values
        last = torch.where(real, t, -1).max(1, keepdim=True).values
        count = real.sum(1, keepdim=True)
        bad = ((count == 0) | (count != last - first + 1))[:, 0].nonzero()[:, 0].tolist()
        if bad:
            raise ValueError(f"attention_mask must give each row one contiguous run of real tokens, padded left or "
                             f"right; not so in row(s) {', '.join(map(str, bad))}")
        if position_ids is not None and bool(((position_ids == 0) & real & (t > first)).any()):
            raise ValueError("position_ids start a document inside a padded row's real tokens; a batch is padded or "
                             "packed, not both")
        after = first + count  # the first right pad
        positions = torch.where(t < first, t, torch.where(t < after, t - first, t - after))
        return cls(positions, real=real)

    @cached_property
    def last_start(self) -> torch.Tensor:
        """[B]: where each row's last segment starts (a decode cache continues it)."""
        return self.document_start[:, -1]

    def __init__(self, position_ids: torch.Tensor, context=None, real: torch.Tensor | None = None):
        B, T = position_ids.shape
        self.context, self.length, self.real = context, T, real
        self.start, self.end = (0, T) if context is None else context.bounds(T)
        starts = position_ids == 0
        starts[:, 0] = True
        t = torch.arange(T, device=position_ids.device)
        # [B, T]: the index of each token's segment start in its row (equal within a segment, so it names it)
        self.document_start = torch.where(starts, t, 0).cummax(1).values
        self.position_ids = position_ids[:, self.start:self.end]
        self.starts = starts[:, self.start:self.end]
        rows = self.starts.clone()
        rows[:, 0] = True  # the flattened slice starts a segment at every row
        L = self.end - self.start
        self.cu_seqlens = F.pad(rows.flatten().nonzero()[:, 0], (0, 1), value=B * L)
        self.last_segment = rows.sum(1).cumsum(0) - 1
        self.cut = self.starts.any(1)
        first_start = torch.where(self.starts, torch.arange(L, device=t.device), L).min(1).values
        self.head = torch.where(self.starts[:, 0], 0, first_start)
        self._conv_crossings: dict[int, tuple] = {}
        self._repeated: dict[int, DocumentSegments] = {}

    @cached_property
    def segment_ids(self) -> torch.Tensor:
        """[B, end]: a name of each token's segment, the same for all its tokens (its start's index), for the
        keys up to the slice's end (the whole row without context parallelism)."""
        return self.document_start[:, :self.end]

    @cached_property
    def one_document(self) -> bool:
        """Whether every row holds one document up to the slice's end (attention then needs no mask but causality)."""
        return not bool(self.segment_ids.any())

    @cached_property
    def attention_mask(self):
        seg = self.segment_ids
        B, S = seg.shape
        q_seg, offset = seg[:, self.start:], self.start
        if seg.is_cuda:
            from torch.nn.attention.flex_attention import create_block_mask

            def same_document_causal(b, h, q_idx, kv_idx):
                return (seg[b, offset + q_idx] == seg[b, kv_idx]) & (offset + q_idx >= kv_idx)

            return create_block_mask(same_document_causal, B, None, S - offset, S, device=seg.device)
        causal = torch.ones(S - offset, S, dtype=torch.bool, device=seg.device).tril(offset)
        return ((q_seg[:, :, None] == seg[:, None, :]) & causal)[:, None]

    def conv_crossings(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, token, lag) of the taps that read a token before their token's segment start: within the slice
        (token >= lag), and under context parallelism past rank 0 also in the previous rank's halo (token < lag)."""
        if width not in self._conv_crossings:
            B, L = self.starts.shape
            t = torch.arange(L, device=self.starts.device)
            pos = self.start + t - self.document_start[:, self.start:self.end]  # the token's place in its segment
            # before token 0 a conv reads zeros (nothing to undo), past rank 0 the previous rank's halo
            taps = [((pos < lag) & ((t >= lag) | (self.start > 0))).nonzero() for lag in range(1, width)]
            lags = torch.cat([torch.full((len(tap),), lag, device=t.device) for lag, tap in enumerate(taps, 1)])
            b, tok = torch.cat(taps).unbind(1)
            self._conv_crossings[width] = (b, tok, lags)
        return self._conv_crossings[width]

    def flatten(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [1, B T, ...], the layout cu_seqlens indexes."""
        return x.reshape(1, -1, *x.shape[2:])

    def repeated(self, steps: int) -> "DocumentSegments":
        """The segments of the rows with each token repeated `steps` times in place (t0, t0, .., t1, t1, ..): a
        sequence of several state updates per token (DeltaProduct's Householder steps) cut where this one is,
        each rank's slice `steps` times as long. Built once per forward and steps, shared by the layers."""
        if steps not in self._repeated:
            T = self.length
            within = torch.arange(T, device=self.document_start.device) - self.document_start  # whole rows'
            positions = (within[..., None] * steps + torch.arange(steps, device=within.device)).flatten(1)
            real = None if self.real is None else self.real.repeat_interleave(steps, 1)
            self._repeated[steps] = DocumentSegments(positions, self.context, real)
        return self._repeated[steps]


def continued_positions(cache: dict | None, segments: DocumentSegments | None, T: int, device) -> torch.Tensor | None:
    """Rotary positions [B, T] of an attention mixer's call: the segments' where given (a cache filled through them
    keeps each row's last_start); on a cache's later calls, counted from that start; None where the positions are
    the cache's offset onwards."""
    if segments is not None:
        if cache is not None:
            cache["start"] = segments.last_start
        return segments.position_ids
    if cache is None or "start" not in cache:
        return None
    return cache["offset"] + torch.arange(T, device=device) - cache["start"][:, None]
