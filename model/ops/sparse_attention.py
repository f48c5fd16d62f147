"""DeepSeek Sparse Attention (DSA) ops: attention restricted to the keys each query selected (the lightning
indexer and its top-k selection: model/ops/lightning_indexer.py). Layouts as in the kernels: q [B, T, H, D], k, v [B, S, Hkv, D] (GQA: H a multiple
of Hkv), indexer q_i [B, T, H_I, d_I], shared indexer key k_i [B, S, d_I], head weights w [B, T, H_I];
`indices` [B, T, K] int64 holds, per query, the key positions it may attend to, -1 for an empty slot
(FlashMLA's sparse convention). The T queries sit at positions S - T .. S - 1 of the S keys.

Two paths compute attention over the selected keys, with the same outputs and gradients:
  sparse (`sparse_attention`): per query row, logits = the selected keys' dot products (an SDDMM),
      softmax over its K entries, output = the probability-weighted sum of the selected values (an
      SpMM); the hand-written backward is one more SDDMM (dP), an SpMM (dQ) and two transposed SpMMs
      (dK, dV), all through `Selection` (numba kernels on CPU, cuSPARSE elsewhere): no gathered copies
      of keys in memory. Cost O(B T K H D); saves P, O(B T H K).
  masked (`masked_attention`): fused SDPA under the [T, S] boolean top-k mask, queries in blocks so
      each block reads only the keys it can see: dense FLOPs, O(T S H D), in the fused kernel.
`selected_attention` picks the cheaper by `attention_path`'s cost model and logs the choice once per
shape. The naive references at the end are the tests' oracles: `naive_masked_attention`, a dense
masked O(T S d) einsum (both paths' outputs and gradients), and a per-query loop from the formula.
Everything accumulates in fp32 (fp64 for fp64 inputs). No installable GPU kernel fits these shapes
(docs/studies/dsa.md), so CUDA tensors run these same paths (cuSPARSE / fused SDPA).
"""
import functools
import logging
import warnings

import torch
import torch.nn.functional as F

from model.ops import sparse_cpu
from model.ops.kernels import accumulation_dtype, own_precision, repeat_heads

logger = logging.getLogger(__name__)

_BLOCK_ELEMS = 1 << 22  # temporaries per query block of the dense ops, in elements (16 MiB at fp32)


def _blocks(T: int, elems_per_query: int, budget: int | None = None):
    n = max(1, (_BLOCK_ELEMS if budget is None else budget) // max(1, elems_per_query))
    for t0 in range(0, T, n):
        yield t0, min(T, t0 + n)


def causal_mask(T: int, S: int, offset: int, device) -> torch.Tensor:
    """[T, S] bool: key s is visible to query t iff s <= offset + t."""
    return torch.arange(S, device=device)[None, :] <= torch.arange(offset, offset + T, device=device)[:, None]


# ---- the selection as sparse matrices -----------------------------------------------------------

class Selection:
    """`indices` [B, T, K] over S keys, prepared once per layer call for the ops restricted to the
    selected keys, over query rows r = b T + t and key rows n = b S + s, with G = H / Hkv query heads per
    key head: `logits` (scale q[r, h] . k[n_rj, h // G], an SDDMM), `gathered_sum` (an SpMM) and
    `scattered_sum` (its transpose), softmax `attention` over the selected keys and its backward
    `attention_grads` from them, and the indexer's `index_scores` with `index_grads`.
    backend "numba" (the default on CPU): the kernels of model.ops.sparse_cpu on `key_rows` ([B T, K] key
    rows, -1 = empty), which read each selected key row once for a whole head group.
    "csr" (the default elsewhere: cuSPARSE): torch.sparse, one head at a time, through the CSR [B T, B S]
    of the selection and, built on first use, the CSR of its transpose, with the elementwise steps in
    torch ops. Both hold the selected entries only (empty slots left out), each row's columns sorted and
    distinct, as cuSPARSE's CSR routines assume; `slots` maps the entries to the [B T, K] slots."""

    BACKENDS = ("numba", "csr")

    def __init__(self, indices: torch.Tensor, num_keys: int, backend: str | None = None):
        B, T, K = indices.shape
        self.backend = backend or ("numba" if _numba_runs(indices.device) else "csr")
        if self.backend not in self.BACKENDS:
            raise ValueError(f"Selection backend {self.backend!r}: choose one of {self.BACKENDS}")
        if self.backend == "numba" and indices.device.type != "cpu":
            raise ValueError(f"Selection backend 'numba' runs on CPU tensors only, not {indices.device.type}")
        self.indices, self.num_keys = indices, num_keys
        self.valid = indices >= 0
        # int32 positions where they fit: the sparse kernels (numba, MKL, cuSPARSE) then index with
        # 32-bit numbers, and torch.sparse would otherwise convert both index arrays on every call
        fits = max(B * T * K, B * num_keys) < 2**31
        self.index_dtype = torch.int32 if fits else torch.long
        base = torch.arange(B, device=indices.device).view(B, 1, 1) * num_keys
        if self.backend == "numba":
            self.key_rows = (indices + base).masked_fill(~self.valid, -1).view(B * T, K).to(self.index_dtype)
        else:  # each row's keys in ascending order, the empty slots (sent past the last key) dropped
            cols, order = (indices + base).masked_fill(~self.valid, B * num_keys).view(B * T, K).sort(-1)
            kept = cols < B * num_keys
            self.col = cols[kept].to(self.index_dtype)
            self.crow = F.pad(kept.sum(-1).cumsum(0), (1, 0)).to(self.index_dtype)
            # slots[i]: the flat slot r K + j of the i-th entry (values [B T, K] -> entries and back)
            self.slots = (order + torch.arange(0, B * T * K, K, device=indices.device)[:, None])[kept]

    @property
    def rows(self) -> int:
        return self.indices.shape[0] * self.indices.shape[1]

    @property
    def col_count(self) -> int:
        return self.indices.shape[0] * self.num_keys

    def logits(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B T, H, D], k [B S, Hkv, D] -> [B T, H, K]: scale q[r, h] . k[n_rj, h // G], -inf in empty
        slots (an SDDMM)."""
        if self.backend == "numba":
            return sparse_cpu.logits(q, k, self.key_rows, scale)
        return self._dots(q, k).mul_(scale).masked_fill_(~self.valid.view(self.rows, 1, -1), float("-inf"))

    def gathered_sum(self, c: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """c [B T, H, K], b [B S, Hkv, D] -> [B T, H, D]: sum_j c[r, h, j] b[n_rj, h // G] (an SpMM)."""
        if self.backend == "numba":
            return sparse_cpu.gathered_sum(c, b, self.key_rows)
        G = c.shape[1] // b.shape[1]
        return torch.stack([self.matrix(c[:, h]) @ b[:, h // G] for h in range(c.shape[1])], 1)

    def attention(self, q, k, v, scale: float):
        """(p [B T, H, K], o [B T, H, Dv], probs [B T, K]): p = softmax over the selected keys of scale
        dots(q, k) (0 in empty slots), o = gathered_sum(p, v), probs = p averaged over heads."""
        p = self.logits(q, k, scale).softmax(-1)
        return p, self.gathered_sum(p, v), p.mean(1)

    def scattered_sum(self, c: torch.Tensor, a: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """c [B T, H, K], a [B T, H, D] -> [B S, Hkv, D]: the transpose of gathered_sum (an SpMM^T)."""
        if self.backend == "numba":
            return sparse_cpu.scattered_sum(c, a, self.key_rows, self.col_count, kv_heads)
        G = c.shape[1] // kv_heads
        return torch.stack([sum(self.matrix_t(c[:, h]) @ a[:, h] for h in range(g * G, (g + 1) * G))
                            for g in range(kv_heads)], 1)

    def attention_grads(self, do, o, p, q, k, v, scale: float):
        """The backward of `attention` given do [B T, H, Dv]: (dq, dk, dv)."""
        delta = (do * o).sum(-1)  # [B T, H]: sum_j p_j dp_j
        if self.backend == "numba":
            ds = sparse_cpu.softmax_grads(do, v, p, delta, self.key_rows, scale)
        else:  # softmax backward, times d(logit)/d(q.k)
            ds = p * (self._dots(do, v) - delta[:, :, None]) * scale
        Hkv = k.shape[1]
        return self.gathered_sum(ds, k), self.scattered_sum(ds, q, Hkv), self.scattered_sum(p, do, Hkv)

    def index_scores(self, q, k, w):
        """The indexer at the selection, q [B T, H_I, d], k [B S, 1, d], w [B T, H_I]: (dots [B T, H_I, K],
        I = sum_h w_h relu(dots_h) [B T, K], -inf in empty slots)."""
        if self.backend == "numba":
            return sparse_cpu.index_scores(q, k, w, self.key_rows)
        dots = self._dots(q, k)
        return dots, (dots.relu() * w[:, :, None]).sum(1).masked_fill_(~self.valid.view(self.rows, -1), float("-inf"))

    def index_grads(self, grad, dots, q, k, w):
        """The backward of `index_scores` (k given as [B S, d]) given grad [B T, K]: (dq, dk, dw)."""
        if self.backend == "numba":
            return sparse_cpu.index_grads(grad, dots, q, k, w, self.key_rows)
        g = grad[:, None].masked_fill(~self.valid.view(self.rows, 1, -1), 0)
        ddots = g * w[:, :, None] * (dots > 0)  # d relu(x) = [x > 0]
        return self.gathered_sum(ddots, k[:, None]), self.scattered_sum(ddots, q, 1)[:, 0], (dots.relu() * g).sum(-1)

    # ---- the csr backend

    def _dots(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a [B T, H, D], b [B S, Hkv, D] -> [B T, H, K]: a[r, h] . b[n_rj, h // G], 0 in empty slots."""
        G = a.shape[1] // b.shape[1]
        return torch.stack([self._sampled_dots(a[:, h].contiguous(), b[:, h // G].contiguous())
                            for h in range(a.shape[1])], 1)

    @functools.cached_property
    def _transposed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(crow, col, slots) of the transpose [B S, B T]: the entries by key (a stable sort keeps each
        key's query rows ascending, as the CSR's rows are); slots as `slots`, in this order."""
        keys = self.col.long()
        order = keys.sort(stable=True).indices
        slots = self.slots.index_select(0, order)
        query = (slots // self.indices.shape[2]).to(self.index_dtype)
        crow = torch.zeros(self.col_count + 1, dtype=self.index_dtype, device=keys.device)
        crow[1:] = torch.bincount(keys, minlength=self.col_count).cumsum(0)
        return crow, query, slots

    def matrix(self, values: torch.Tensor) -> torch.Tensor:
        """CSR [B T, B S] with `values` [B T, K] at the selected entries (empty slots dropped)."""
        return _csr(self.crow, self.col, values.reshape(-1).index_select(0, self.slots), (self.rows, self.col_count))

    def matrix_t(self, values: torch.Tensor) -> torch.Tensor:
        """CSR [B S, B T]: the transpose of matrix(values)."""
        crow, col, slots = self._transposed
        return _csr(crow, col, values.reshape(-1).index_select(0, slots), (self.col_count, self.rows))

    def _sampled_dots(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a [B T, D], b [B S, D] -> [B T, K]: a[row] . b[col] at each selected entry (one head), 0 in
        empty slots."""
        out = _csr(self.crow, self.col, a.new_zeros(self.col.numel()), (self.rows, self.col_count))
        torch.sparse.sampled_addmm(out, a, b.t(), beta=0.0, out=out)  # in place: no copy of the structure
        return a.new_zeros(self.indices.numel()).index_copy_(0, self.slots, out.values()).view(self.rows, -1)


def _csr(crow, col, values, size) -> torch.Tensor:
    with warnings.catch_warnings():  # torch warns that CSR support is in beta
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)


def _numba_runs(device: torch.device) -> bool:
    """Whether the numba kernels (model.ops.sparse_cpu) serve tensors on this device: CPU only."""
    return device.type == "cpu"


def _as_selection(indices, num_keys: int) -> Selection:
    return indices if isinstance(indices, Selection) else Selection(indices, num_keys)


def _rows(x: torch.Tensor, acc) -> torch.Tensor:
    """[B, S, H, D] -> [B S, H, D] in acc dtype, contiguous: the kernels' layout."""
    return x.to(acc).reshape(-1, *x.shape[2:]).contiguous()


# ---- attention over the selected keys -----------------------------------------------------------

class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sel, scale):
        B, T, H, _ = q.shape
        acc = accumulation_dtype(q.dtype)
        qr, kr, vr = _rows(q, acc), _rows(k, acc), _rows(v, acc)  # [B T, H, D], [B S, Hkv, D]
        p, o, probs = sel.attention(qr, kr, vr, scale)  # [B T, H, K], [B T, H, Dv], [B T, K]
        ctx.save_for_backward(qr, kr, vr, o, p)
        ctx.sel, ctx.scale, ctx.dtypes = sel, scale, (q.dtype, k.dtype, v.dtype)
        probs = probs.view(sel.indices.shape)  # head-averaged, the indexer's KL target
        ctx.mark_non_differentiable(probs)
        return o.view(B, T, H, -1).to(q.dtype), probs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, _):
        qr, kr, vr, o, p = ctx.saved_tensors
        sel, scale = ctx.sel, ctx.scale
        dq, dk, dv = sel.attention_grads(_rows(do, p.dtype), o, p, qr, kr, vr, scale)
        B, T, S = sel.indices.shape[0], sel.indices.shape[1], sel.num_keys
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        return (dq.view(B, T, *dq.shape[1:]).to(q_dtype), dk.view(B, S, *dk.shape[1:]).to(k_dtype),
                dv.view(B, S, *dv.shape[1:]).to(v_dtype), None, None)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


@own_precision
def sparse_attention_with_probs(q, k, v, indices, scale: float | None = None):
    """The sparse path: (o [B, T, H, Dv], p [B, T, K]), o[t, h] = sum_{s in indices[t]} softmax_s(scale
    q[t, h] . k[s, h']) v[s, h'] (h' the KV head of h), differentiable in q, k, v; p the head-averaged
    softmax over the selected keys (detached, 0 in empty slots). Every query needs one selected key."""
    return _SparseAttention.apply(q, k, v, _as_selection(indices, k.shape[1]), _scale(q, scale))


def sparse_attention(q, k, v, indices, scale: float | None = None) -> torch.Tensor:
    """The sparse path's output alone."""
    return sparse_attention_with_probs(q, k, v, indices, scale)[0]


@own_precision
def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices, scale: float | None = None
                     ) -> torch.Tensor:
    """The masked path: the same attention as `sparse_attention` through fused SDPA under the boolean
    top-k mask, per block of queries over the keys the block can see (the T queries are the last T of
    the S keys); autograd through SDPA. Dense FLOPs, O(T S H D)."""
    indices = indices.indices if isinstance(indices, Selection) else indices
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H(kv), T, D]
    outs = []
    for t0, t1 in _blocks(T, B * (H + 1) * S):
        keys = S - T + t1  # keys the block's last query can see
        slots = indices[:, t0:t1].masked_fill(indices[:, t0:t1] < 0, keys)  # empty slots -> a dropped column
        mask = torch.zeros(B, t1 - t0, keys + 1, dtype=torch.bool, device=q.device).scatter_(-1, slots, True)
        outs.append(F.scaled_dot_product_attention(qh[:, :, t0:t1], kh[:, :, :keys], vh[:, :, :keys],
                                                   attn_mask=mask[:, None, :, :keys], scale=_scale(q, scale),
                                                   enable_gqa=H != Hkv))
    return torch.cat(outs, 2).transpose(1, 2)


# Time of the sparse path per selected key over the masked path's per visible key, both per query head
# and fwd + bwd; the CPU figure is measured by `python scripts/bench.py dsa` (it prints both paths and
# this model's pick) with as many KV heads as query heads, where the numba kernels share no key rows
# between heads (fewer KV heads make the sparse path cheaper still). CUDA: unmeasured guess (cuSPARSE
# SDDMM/SpMM vs fused masked SDPA).
SPARSE_KEY_COST = {"cpu": 3.0, "cuda": 30.0}
_logged_choices: set = set()


def attention_path(T: int, S: int, K: int, heads: int, kv_heads: int, device_type: str) -> str:
    """"sparse" or "masked", whichever the cost model says is cheaper for T queries (the last T of S keys)
    selecting K keys each. Both paths cost about per query head (SDPA expands GQA; the sparse path does
    an SDDMM/SpMM's work per query head), so heads and KV heads scale both alike and the choice reduces to
    K * SPARSE_KEY_COST[device] vs the mean keys a query block reads, S - T / 2. Logs the first use of
    each path per (device, top-k, heads, KV heads)."""
    masked_keys = S - T / 2
    choice = "sparse" if K * SPARSE_KEY_COST.get(device_type, SPARSE_KEY_COST["cuda"]) < masked_keys else "masked"
    key = (choice, device_type, K, heads, kv_heads)  # not T, S: decoding would log every token
    if key not in _logged_choices:
        _logged_choices.add(key)
        logger.info("dsa attention: %s path from T=%d, S=%d on (top-k %d, %d heads / %d KV heads, %s)",
                    choice, T, S, K, heads, kv_heads, device_type)
    return choice


def selected_attention(q, k, v, indices, scale: float | None = None, with_probs: bool = False):
    """Attention over the selected keys by the path `attention_path` picks: (o, p), p as in
    `sparse_attention_with_probs` when with_probs (else None)."""
    B, T, H, _ = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    if attention_path(T, S, indices.indices.shape[-1] if isinstance(indices, Selection) else indices.shape[-1],
                      H, Hkv, q.device.type) == "sparse":
        o, p = sparse_attention_with_probs(q, k, v, indices, scale)
        return o, (p if with_probs else None)
    o = masked_attention(q, k, v, indices, scale)
    return o, (selected_attention_probs(q, k, indices, scale) if with_probs else None)


# ---- detached attention probabilities (indexer targets and recall) ---------------------------------

@own_precision
@torch.no_grad()
def selected_attention_probs(q: torch.Tensor, k: torch.Tensor, indices, scale: float | None = None) -> torch.Tensor:
    """p [B, T, K]: softmax over the selected keys, averaged over heads (so L1-normalised), 0 in empty
    slots; the sparse stage's indexer target when the masked path ran (one sampled product)."""
    sel = _as_selection(indices, k.shape[1])
    acc = accumulation_dtype(q.dtype)
    p = sel.logits(_rows(q, acc), _rows(k, acc), _scale(q, scale)).softmax(-1).mean(1)  # [B T, K]
    return p.view(sel.indices.shape)


@own_precision
@torch.no_grad()
def dense_attention_probs(q: torch.Tensor, k: torch.Tensor, offset: int = 0,
                          scale: float | None = None, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """p [B, T, S]: causal softmax attention over all keys (within each document given segment_ids [B, S], the
    keys' documents, the queries' those of the last T keys), averaged over heads (L1-normalised); the warm-up
    indexer target and the reference for top-k recall."""
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    acc = accumulation_dtype(q.dtype)
    kf = k.to(acc)
    p = torch.empty(B, T, S, dtype=acc, device=q.device)
    for t0, t1 in _blocks(T, 2 * B * H * S):
        qb = q[:, t0:t1].to(acc).view(B, t1 - t0, Hkv, H // Hkv, D)
        s = torch.einsum("bnhgd,bshd->bnhgs", qb, kf) * _scale(q, scale)
        mask = causal_mask(t1 - t0, S, offset + t0, q.device).expand(B, -1, -1)
        if segment_ids is not None:
            mask = mask & (segment_ids[:, S - T + t0:S - T + t1, None] == segment_ids[:, None, :])
        p[:, t0:t1] = s.masked_fill(~mask[:, :, None, None], float("-inf")).softmax(-1).mean((2, 3))
    return p


# ---- naive references (the tests' oracles, float64) ---------------------------------------------------
def naive_sparse_attention(q, k, v, indices):
    """o[b, t, h] = sum_{s in sel} softmax_s(q . k_s / sqrt(D)) v_s over the selected s (-1 = none)."""
    B, T, H, D = q.shape
    G = H // k.shape[2]
    o = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for t in range(T):
            sel = [int(s) for s in indices[b, t] if s >= 0]
            for h in range(H):
                logits = torch.stack([q[b, t, h] @ k[b, s, h // G] for s in sel]) * D**-0.5
                p = logits.softmax(0)
                o[b, t, h] = sum(p[i] * v[b, s, h // G] for i, s in enumerate(sel))
    return o


def naive_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """Dense masked einsum, O(T S d): the attention both paths compute, through a [B, T, S] mask
    (differentiable, so the paths' gradients are checked against it too)."""
    B, T, H, D = q.shape
    S = k.shape[1]
    # Empty slots scatter into an extra column that is dropped.
    selected = torch.zeros(B, T, S + 1, dtype=torch.bool, device=q.device)
    selected = selected.scatter(-1, indices.masked_fill(indices < 0, S), True)[..., :S]
    k, v = repeat_heads(k, H), repeat_heads(v, H)
    s = torch.einsum("bthd,bshd->bhts", q, k) * _scale(q, scale)
    p = s.masked_fill(~selected[:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshd->bthd", p, v)
