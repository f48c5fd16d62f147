"""DeepSeek Sparse Attention (DSA) ops: the lightning indexer, top-k selection, and attention restricted
to the selected keys. Layouts as in the kernels: q [B, T, H, D], k, v [B, S, Hkv, D] (GQA: H a multiple
of Hkv), indexer q_i [B, T, H_I, d_I], shared indexer key k_i [B, S, d_I], head weights w [B, T, H_I];
`indices` [B, T, K] int64 holds, per query, the key positions it may attend to, -1 for an empty slot
(FlashMLA's sparse convention). The T queries sit at positions offset .. offset + T - 1 of the S keys.

Indexer score (scales folded into q_i and w by the caller):  I[t, s] = sum_j w[t, j] relu(q_i[t, j] . k_i[s]).

The gather path (`sparse_attention`, `index_scores_at`) costs O(T K d): each block of queries gathers its
selected keys; backward recomputes the gathers from the saved inputs (flash-style), so the activations
kept are O(T (H D + K)), not O(T K D). `sparse_attention_reference` is the dense masked O(T S d) path the
tests check it against. Everything accumulates in fp32 (fp64 for fp64 inputs). There is no GPU kernel
for these shapes (FlashMLA's sparse kernels are MLA-only), so CUDA tensors run this same PyTorch code.
"""
import functools

import torch

_BLOCK_ELEMS = 1 << 22  # temporaries per query block, in elements (16 MiB at fp32)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _own_precision(fn):
    """Run an op with autocast off, as a kernel would: it accumulates in fp32 whatever the input dtype
    (autocast would otherwise round the fp32 scores and probabilities to bf16)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)
    return wrapped


def _blocks(T: int, elems_per_query: int):
    n = max(1, _BLOCK_ELEMS // max(1, elems_per_query))
    for t0 in range(0, T, n):
        yield t0, min(T, t0 + n)


def _flat(indices: torch.Tensor, heads: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row numbers [B, heads, n, K] into x.flatten(0, 2) for x [B, heads, S, D] (empty slots sent to the
    head's row 0), and the validity mask [B, n, K]."""
    valid = indices >= 0
    base = torch.arange(indices.shape[0] * heads, device=indices.device).view(-1, heads, 1, 1) * S
    return indices.clamp(min=0)[:, None] + base, valid


def _gather(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Rows of x [rows, D] at flat [..., K] -> [..., K, D]."""
    return x.index_select(0, flat.flatten()).view(*flat.shape, x.shape[-1])


def _scatter_add(out: torch.Tensor, flat: torch.Tensor, src: torch.Tensor) -> None:
    """out[flat] += src, repeated rows summed (index_put_: ~8x faster than index_add_ on 2 CPU threads here)."""
    out.index_put_((flat.flatten(),), src.reshape(-1, out.shape[-1]), accumulate=True)


def _outer_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., G, K], b [..., G, D] -> a^T b = sum_g a[..., g, :, None] b[..., g, None, :], [..., K, D]."""
    if a.shape[-2] == 1:  # an outer product: broadcasting is several times faster than bmm on CPU
        return a.transpose(-1, -2) * b
    return a.transpose(-1, -2) @ b


def causal_mask(T: int, S: int, offset: int, device) -> torch.Tensor:
    """[T, S] bool: key s is visible to query t iff s <= offset + t."""
    return torch.arange(S, device=device)[None, :] <= torch.arange(offset, offset + T, device=device)[:, None]


# ---- lightning indexer --------------------------------------------------------------------------

@_own_precision
def index_scores(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Dense causal indexer scores [B, T, S] (fp32, -inf on future keys); differentiable, O(T S H_I d_I)
    memory: the warm-up stage's indexer logits and the selection's building block."""
    acc = _acc_dtype(q_i)
    dots = torch.einsum("bthd,bsd->bths", q_i.to(acc), k_i.to(acc)).relu()
    scores = torch.einsum("bth,bths->bts", w.to(acc), dots)
    return scores.masked_fill(~causal_mask(q_i.shape[1], k_i.shape[1], offset, q_i.device), float("-inf"))


@_own_precision
@torch.no_grad()
def index_topk(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, topk: int, offset: int = 0) -> torch.Tensor:
    """indices [B, T, min(topk, S)] of the top-k visible keys by I per query, -1 where fewer than topk
    keys are visible (so a prefix of <= topk keys is selected whole). Ties are broken arbitrarily."""
    B, T, H_I, _ = q_i.shape
    S = k_i.shape[1]
    K = min(topk, S)
    out = torch.full((B, T, K), -1, dtype=torch.long, device=q_i.device)
    for t0, t1 in _blocks(T, B * H_I * S):
        S_blk = offset + t1  # keys visible to the last query of the block
        scores = index_scores(q_i[:, t0:t1], k_i[:, :S_blk], w[:, t0:t1], offset + t0)
        idx = scores.topk(min(K, S_blk), dim=-1).indices
        pos = torch.arange(offset + t0, offset + t1, device=q_i.device)
        out[:, t0:t1, : idx.shape[-1]] = idx.masked_fill(idx > pos[:, None], -1)
    return out


class _IndexScoresAt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_i, k_i, w, indices):
        B, T, H_I, d = q_i.shape
        K = indices.shape[-1]
        acc = _acc_dtype(q_i)
        out = torch.empty(B, T, K, dtype=acc, device=q_i.device)
        kf = k_i.flatten(0, 1)
        for t0, t1 in _blocks(T, B * K * (d + H_I)):
            flat, valid = _flat(indices[:, t0:t1], 1, k_i.shape[1])
            ks = _gather(kf, flat[:, 0]).to(acc)  # [B, n, K, d]
            dots = q_i[:, t0:t1].to(acc) @ ks.transpose(-1, -2)  # [B, n, H_I, K]
            scores = (w[:, t0:t1, None].to(acc) @ dots.relu())[:, :, 0]
            out[:, t0:t1] = scores.masked_fill(~valid, float("-inf"))
        ctx.save_for_backward(q_i, k_i, w, indices)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q_i, k_i, w, indices = ctx.saved_tensors
        B, T, H_I, d = q_i.shape
        S, K = k_i.shape[1], indices.shape[-1]
        acc = grad.dtype
        dq = torch.empty(q_i.shape, dtype=acc, device=q_i.device)
        dw = torch.empty(w.shape, dtype=acc, device=w.device)
        dk = torch.zeros(B * S, d, dtype=acc, device=k_i.device)
        kf = k_i.flatten(0, 1)
        for t0, t1 in _blocks(T, B * K * (d + 2 * H_I)):
            flat, valid = _flat(indices[:, t0:t1], 1, S)
            ks = _gather(kf, flat[:, 0]).to(acc)
            qb, wb = q_i[:, t0:t1].to(acc), w[:, t0:t1].to(acc)
            g = grad[:, t0:t1].masked_fill(~valid, 0)[:, :, None]  # [B, n, 1, K]; empty slots are constant
            dots = qb @ ks.transpose(-1, -2)
            dw[:, t0:t1] = (dots.relu() * g).sum(-1)
            ddots = g * wb[..., None] * (dots > 0)  # d relu(x) = [x > 0]
            dq[:, t0:t1] = ddots @ ks
            _scatter_add(dk, flat, _outer_sum(ddots, qb))
        return dq.to(q_i.dtype), dk.view(k_i.shape).to(k_i.dtype), dw.to(w.dtype), None


@_own_precision
def index_scores_at(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Indexer scores at the selected keys only: [B, T, K] (fp32), -inf in empty slots; differentiable
    in q_i, k_i, w; O(T K d_I) compute, O(T K) saved memory (the sparse stage's indexer logits)."""
    return _IndexScoresAt.apply(q_i, k_i, w, indices)


# ---- attention over the selected keys -----------------------------------------------------------

def _by_head(x: torch.Tensor) -> torch.Tensor:
    """[B, S, Hkv, D] -> rows [B * Hkv * S, D], the layout gathered from."""
    return x.transpose(1, 2).flatten(0, 2)


def _selected_logits(qb, kh, flat, valid, scale):
    """qb [B, Hkv, n, G, D] (acc dtype) against the gathered keys -> (logits [B, Hkv, n, G, K], -inf in
    empty slots; gathered keys [B, Hkv, n, K, D])."""
    ks = _gather(kh, flat).to(qb.dtype)
    s = (qb @ ks.transpose(-1, -2)) * scale
    return s.masked_fill(~valid[:, None, :, None, :], float("-inf")), ks


def _query_block(x: torch.Tensor, t0: int, t1: int, Hkv: int, acc) -> torch.Tensor:
    """x[:, t0:t1] [B, n, H, D] -> [B, Hkv, n, G, D] in acc dtype."""
    B, _, H, D = x.shape
    return x[:, t0:t1].to(acc).view(B, t1 - t0, Hkv, H // Hkv, D).transpose(1, 2)


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale):
        B, T, H, D = q.shape
        S, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
        K, G = indices.shape[-1], H // Hkv
        acc = _acc_dtype(q)
        kh, vh = _by_head(k), _by_head(v)
        o = torch.empty(B, T, H, Dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, Hkv, T, G, dtype=acc, device=q.device)
        for t0, t1 in _blocks(T, B * K * (Hkv * (D + Dv) + 2 * H)):
            flat, valid = _flat(indices[:, t0:t1], Hkv, S)
            s, _ = _selected_logits(_query_block(q, t0, t1, Hkv, acc), kh, flat, valid, scale)
            lse[:, :, t0:t1] = s.logsumexp(-1)
            p = (s - lse[:, :, t0:t1, :, None]).exp()  # softmax over the selected keys
            ob = p @ _gather(vh, flat).to(acc)  # [B, Hkv, n, G, Dv]
            o[:, t0:t1] = ob.transpose(1, 2).reshape(B, t1 - t0, H, Dv).to(q.dtype)
        ctx.save_for_backward(q, k, v, indices, o, lse)
        ctx.scale = scale
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, indices, o, lse = ctx.saved_tensors
        scale = ctx.scale
        B, T, H, D = q.shape
        S, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
        K = indices.shape[-1]
        acc = lse.dtype
        kh, vh = _by_head(k), _by_head(v)
        dq = torch.empty(B, T, H, D, dtype=acc, device=q.device)
        dk = torch.zeros(B * Hkv * S, D, dtype=acc, device=q.device)
        dv = torch.zeros(B * Hkv * S, Dv, dtype=acc, device=q.device)
        for t0, t1 in _blocks(T, B * K * (2 * Hkv * (D + Dv) + 3 * H)):
            flat, valid = _flat(indices[:, t0:t1], Hkv, S)
            qb = _query_block(q, t0, t1, Hkv, acc)
            s, ks = _selected_logits(qb, kh, flat, valid, scale)
            p = (s - lse[:, :, t0:t1, :, None]).exp()
            vs = _gather(vh, flat).to(acc)
            dob = _query_block(do, t0, t1, Hkv, acc)
            delta = (dob * _query_block(o, t0, t1, Hkv, acc)).sum(-1, keepdim=True)  # sum_j p_j dp_j
            ds = p * (dob @ vs.transpose(-1, -2) - delta) * scale  # softmax backward, times d(logit)/d(q.k)
            dq[:, t0:t1] = (ds @ ks).transpose(1, 2).reshape(B, t1 - t0, H, D)
            _scatter_add(dk, flat, _outer_sum(ds, qb))
            _scatter_add(dv, flat, _outer_sum(p, dob))
        dk = dk.view(B, Hkv, S, D).transpose(1, 2).to(k.dtype)
        dv = dv.view(B, Hkv, S, Dv).transpose(1, 2).to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None


@_own_precision
def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Gather path: o[t, h] = sum_{s in indices[t]} softmax_s(scale q[t, h] . k[s, h']) v[s, h'] (h' the
    KV head of h), [B, T, H, Dv]; every query needs at least one selected key."""
    return _SparseAttention.apply(q, k, v, indices, q.shape[-1] ** -0.5 if scale is None else scale)


@_own_precision
def sparse_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                               scale: float | None = None) -> torch.Tensor:
    """Dense masked path, O(T S d): the same attention as `sparse_attention` through a [B, T, S] mask."""
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    # Empty slots scatter into an extra column that is dropped.
    selected = torch.zeros(B, T, S + 1, dtype=torch.bool, device=q.device)
    selected = selected.scatter(-1, indices.masked_fill(indices < 0, S), True)[..., :S]
    k, v = k.repeat_interleave(H // Hkv, dim=2), v.repeat_interleave(H // Hkv, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, k) * scale
    p = s.masked_fill(~selected[:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshd->bthd", p, v)


# ---- detached attention probabilities (indexer targets and recall) ---------------------------------

@_own_precision
@torch.no_grad()
def selected_attention_probs(q: torch.Tensor, k: torch.Tensor, indices: torch.Tensor,
                             scale: float | None = None) -> torch.Tensor:
    """p [B, T, K]: softmax over the selected keys, averaged over heads (so L1-normalised), 0 in empty
    slots; the sparse stage's indexer target."""
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    K = indices.shape[-1]
    scale = D**-0.5 if scale is None else scale
    acc = _acc_dtype(q)
    p = torch.empty(B, T, K, dtype=acc, device=q.device)
    kh = _by_head(k)
    for t0, t1 in _blocks(T, B * K * (Hkv * D + 2 * H)):
        flat, valid = _flat(indices[:, t0:t1], Hkv, S)
        s, _ = _selected_logits(_query_block(q, t0, t1, Hkv, acc), kh, flat, valid, scale)
        p[:, t0:t1] = s.softmax(-1).mean((1, 3))
    return p


@_own_precision
@torch.no_grad()
def dense_attention_probs(q: torch.Tensor, k: torch.Tensor, offset: int = 0,
                          scale: float | None = None) -> torch.Tensor:
    """p [B, T, S]: causal softmax attention over all keys, averaged over heads (L1-normalised); the
    warm-up indexer target and the reference for top-k recall."""
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    acc = _acc_dtype(q)
    kf = k.to(acc)
    p = torch.empty(B, T, S, dtype=acc, device=q.device)
    for t0, t1 in _blocks(T, 2 * B * H * S):
        qb = q[:, t0:t1].to(acc).view(B, t1 - t0, Hkv, H // Hkv, D)
        s = torch.einsum("bnhgd,bshd->bnhgs", qb, kf) * scale
        mask = causal_mask(t1 - t0, S, offset + t0, q.device)
        p[:, t0:t1] = s.masked_fill(~mask[None, :, None, None], float("-inf")).softmax(-1).mean((2, 3))
    return p
