"""DSA's lightning indexer (DeepSeek-V3.2) and its top-k selection. Layouts as model/ops/sparse_attention:
indexer q_i [B, T, H_I, d_I], shared indexer key k_i [B, S, d_I], head weights w [B, T, H_I]; the T queries sit
at positions S - T .. S - 1 of the S keys. Score (scales folded into q_i and w by the caller):

    I[t, s] = sum_j w[t, j] relu(q_i[t, j] . k_i[s])

`index_topk` selects each query's top-k visible keys (numba on CPU, batched torch ops elsewhere);
`index_scores` is the dense differentiable form (the warm-up stage), `index_scores_at` the scores at the
selected keys only (the sparse stage's indexer logits). `naive_index_scores` (naive.py), a per-query loop from
the formula, is the tests' oracle."""
import math

import torch
import torch.nn.functional as F

from model.ops.kernels import accumulation_dtype, own_precision
# the query blocks, the kernel choice and the kernels as module attributes (tests patch them)
from model.ops.sparse_attention import attention, cpu_kernels, selection

_INDEX_BLOCK_ELEMS = 1 << 22  # indexer dot products per query block (16 MiB at fp32: fits a 32 MiB L3)


@own_precision
def index_scores(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, offset: int = 0,
                 segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Dense causal indexer scores [B, T, S] (fp32, -inf on future keys, and on other documents' keys
    given segment_ids [B, S], as `visible`); differentiable, O(T S H_I d_I) memory: the warm-up stage's indexer
    logits."""
    acc = accumulation_dtype(q_i.dtype)
    dots = torch.einsum("bthd,bsd->bths", q_i.to(acc), k_i.to(acc)).relu()
    scores = torch.einsum("bth,bths->bts", w.to(acc), dots)
    return scores.masked_fill(~visible(q_i.shape[1], k_i.shape[1], offset, q_i.device, segment_ids), float("-inf"))


def visible(T: int, S: int, offset: int, device, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each query may see: causal [T, S], and with segment_ids [B, S] (document masking: the keys'
    documents; the queries, the last T keys, have theirs) also within its own document, [B, T, S]."""
    mask = attention.causal_mask(T, S, offset, device)
    if segment_ids is None:
        return mask
    return mask & (segment_ids[:, S - T:, None] == segment_ids[:, None, :])


def _topk_chunks(S: int, k: int) -> int:
    """Chunk count c of the two-stage top-k: c^-1 S + c k candidates are ranked, least at c = (S / k)^1/2."""
    return int(math.sqrt(S / k))


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the k largest entries of x [..., S] along the last dim, in no order; exact up
    to ties. Two stages when S >> k: split the row into c strided chunks of M = S / c entries (chunk j =
    {j, M + j, 2M + j, ...}); the top k entries lie in the k chunks with the largest maxima (any entry
    outside them is beaten by those k maxima), so rank the M chunk maxima, then the c k entries of the
    k chunks kept."""
    S = x.shape[-1]
    c = _topk_chunks(S, k)
    if c < 2:
        return x.topk(k, dim=-1, sorted=False).indices
    M = -(-S // c)
    if c * M != S:
        x = F.pad(x, (0, c * M - S), value=float("-inf"))
    chunks = x.unflatten(-1, (c, M))  # [..., c, M]; chunk j is column j
    cols = chunks.amax(-2).topk(k, dim=-1, sorted=False).indices  # [..., k] chunks kept
    cand = chunks.gather(-1, cols.unsqueeze(-2).expand(*cols.shape[:-1], c, k)).flatten(-2)  # [..., c k]
    j = cand.topk(k, dim=-1, sorted=False).indices
    return cols.gather(-1, j % k) + (j // k) * M


@own_precision
@torch.no_grad()
def index_topk(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, topk: int, offset: int = 0,
               segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """indices [B, T, min(topk, S)] of the top-k visible keys by I per query, -1 where fewer than topk
    keys are visible (so a prefix of <= topk keys is selected whole); with segment_ids [B, S] (the keys'
    contiguous documents, non-decreasing along S, as DocumentSegments gives; the queries' those of the last T
    keys) only the query's own document is visible. Ties are broken arbitrarily.
    Per block of queries: one GEMM for q_i k_i^T over the keys the block can see, then on CPU one numba
    kernel (cpu_kernels.index_topk: relu, head-weighted sum and top-k over each query's visible keys in
    one pass over the row); elsewhere relu in place, the head-weighted sum as a batched [1, H_I] x
    [H_I, S] product, the invisible keys set to -inf, and `topk_indices`."""
    B, T, H_I, d = q_i.shape
    S = k_i.shape[1]
    K = min(topk, S)
    acc = accumulation_dtype(q_i.dtype)
    out = torch.full((B, T, K), -1, dtype=torch.long, device=q_i.device)
    kt = k_i.to(acc).transpose(1, 2)  # [B, d, S]
    pos = torch.arange(offset, offset + T, device=q_i.device)
    # first visible key of each query: its document's start
    lo = (torch.zeros_like(pos).expand(B, T) if segment_ids is None
          else torch.searchsorted(segment_ids.contiguous(), segment_ids[:, S - T:].contiguous()))
    for t0, t1 in attention._blocks(T, H_I * S, _INDEX_BLOCK_ELEMS):
        n, S_blk = t1 - t0, offset + t1  # keys visible to the block's last query
        dots = torch.bmm(q_i[:, t0:t1].to(acc).reshape(B, n * H_I, d), kt[:, :, :S_blk]).view(B, n, H_I, S_blk)
        wb, k_blk = w[:, t0:t1].to(acc), min(K, S_blk)
        if selection._numba_runs(q_i.device):
            for b in range(B):
                out[b, t0:t1, :k_blk] = cpu_kernels.index_topk(dots[b], wb[b], lo[b, t0:t1], pos[t0:t1], k_blk)
        else:
            out[:, t0:t1, :k_blk] = _block_topk(dots, wb, lo[:, t0:t1], pos[t0:t1], k_blk)
    return out


def _block_topk(dots, w, lo, hi, k):
    """cpu_kernels.index_topk in torch ops, batched (the path for non-CPU tensors): dots [B, n, H_I, S],
    w [B, n, H_I], lo [B, n], hi [n]."""
    scores = torch.matmul(w[:, :, None], dots.relu_()).squeeze(2)  # [B, n, S]
    keys = torch.arange(scores.shape[-1], device=dots.device)
    visible = (keys >= lo[..., None]) & (keys <= hi[:, None])
    idx = topk_indices(scores.masked_fill_(~visible, float("-inf")), k)
    return idx.masked_fill(~visible.gather(-1, idx), -1)


class _IndexScoresAt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_i, k_i, w, sel):
        acc = accumulation_dtype(q_i.dtype)
        rows = selection._rows
        qr, kr, wr = rows(q_i, acc), rows(k_i[:, :, None], acc), rows(w, acc)  # [B T, H_I, d], [B S, 1, d]
        dots, scores = sel.index_scores(qr, kr, wr)  # [B T, H_I, K], [B T, K]
        ctx.save_for_backward(qr, kr, wr, dots)
        ctx.sel, ctx.dtypes = sel, (q_i.dtype, k_i.dtype, w.dtype)
        return scores.view(sel.indices.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        qr, kr, wr, dots = ctx.saved_tensors
        sel = ctx.sel
        dq, dk, dw = sel.index_grads(grad.to(dots.dtype).reshape(sel.rows, -1).contiguous(), dots, qr, kr[:, 0], wr)
        B, T, S = sel.indices.shape[0], sel.indices.shape[1], sel.num_keys
        q_dtype, k_dtype, w_dtype = ctx.dtypes
        return dq.view(B, T, *qr.shape[1:]).to(q_dtype), dk.view(B, S, -1).to(k_dtype), dw.view(B, T, -1).to(w_dtype), None


@own_precision
def index_scores_at(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, indices) -> torch.Tensor:
    """Indexer scores at the selected keys only: [B, T, K] (fp32), -inf in empty slots; differentiable
    in q_i, k_i, w; O(T K H_I d_I) compute through the Selection's sampled products (`indices` a tensor
    or its Selection)."""
    return _IndexScoresAt.apply(q_i, k_i, w, selection._as_selection(indices, k_i.shape[1]))
