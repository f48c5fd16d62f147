"""DSA's ops straight from the formulas: the tests' oracles, run in float64 (the layouts:
model/ops/sparse_attention)."""
import torch

from model.ops.kernels import repeat_heads
from model.ops.sparse_attention.attention import _scale


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


def naive_index_scores(q_i, k_i, w):
    """I[b, t, s] = sum_j w[b, t, j] relu(q_i[b, t, j] . k_i[b, s]) for s <= t, else -inf."""
    B, T, H_I, _ = q_i.shape
    out = torch.full((B, T, k_i.shape[1]), float("-inf"), dtype=q_i.dtype)
    for b in range(B):
        for t in range(T):
            for s in range(t + 1):
                out[b, t, s] = sum(w[b, t, j] * torch.relu(q_i[b, t, j] @ k_i[b, s]) for j in range(H_I))
    return out
