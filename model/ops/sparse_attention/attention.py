"""DSA's attention over the selected keys (the layouts: model/ops/sparse_attention).

Two paths compute attention over the selected keys, with the same outputs and gradients:
  sparse (`sparse_attention`): per query row, logits = the selected keys' dot products (an SDDMM),
      softmax over its K entries, output = the probability-weighted sum of the selected values (an
      SpMM); the hand-written backward is one more SDDMM (dP), an SpMM (dQ) and two transposed SpMMs
      (dK, dV), all through `Selection` (selection.py: numba kernels on CPU, cuSPARSE elsewhere): no
      gathered copies of keys in memory. Cost O(B T K H D); saves P, O(B T H K).
  masked (`masked_attention`): fused SDPA under the [T, S] boolean top-k mask, queries in blocks so
      each block reads only the keys it can see: dense FLOPs, O(T S H D), in the fused kernel.
`selected_attention` picks the cheaper by `attention_path`'s cost model and logs the choice once per
shape. The naive references (naive.py) are the tests' oracles: `naive_masked_attention`, a dense
masked O(T S d) einsum (both paths' outputs and gradients), and a per-query loop from the formula.
"""
import logging

import torch
import torch.nn.functional as F

from model.ops.kernels import accumulation_dtype, own_precision
from model.ops.sparse_attention.selection import Selection, _as_selection, _rows

logger = logging.getLogger(__name__)

_BLOCK_ELEMS = 1 << 22  # temporaries per query block of the dense ops, in elements (16 MiB at fp32)


def _blocks(T: int, elems_per_query: int, budget: int | None = None):
    n = max(1, (_BLOCK_ELEMS if budget is None else budget) // max(1, elems_per_query))
    for t0 in range(0, T, n):
        yield t0, min(T, t0 + n)


def causal_mask(T: int, S: int, offset: int, device) -> torch.Tensor:
    """[T, S] bool: key s is visible to query t iff s <= offset + t."""
    return torch.arange(S, device=device)[None, :] <= torch.arange(offset, offset + T, device=device)[:, None]


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
