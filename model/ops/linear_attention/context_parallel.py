"""Causal linear attention's context-parallel form (the op: model/ops/linear_attention; the exchanges:
model/ops/context_parallel.py).

The state S [K, V] and the normaliser's key sum z [K] only add up (no decay): over a rank's slice of a row
S_out = S_in + B_S and z_out = z_in + B_z, the incoming ones dropped where a document segment starts in the
slice. Each rank runs the unnormalised op on its slice from zero (every segment as without context
parallelism), takes (B_S, B_z) from each row's last segment, all-gathers them in float32 and sums the earlier
ranks' in order (ContextGroup.incoming), then adds the incoming share to the head's tokens (those that continue
the previous rank's segment): numerator + scale q_t^T S_in, key sum + z_in, and normalises. Only (S, z) travels:
H K (V + 1) numbers per row.
"""
import torch

from model.ops.kernels import accumulation_dtype, own_precision
from model.ops.linear_attention.chunk import chunk_linear_attn
from model.ops.varlen import sequence_cumsum


@own_precision
def chunk_linear_attn_cp(q, k, v, segments, normalize: bool = False, chunk_size: int = 64, scale: float | None = None,
                         eps: float = 1e-6):
    """chunk_linear_attn's o [B, L, H, V] over this rank's slice of every row (segments: its DocumentSegments with a
    context), equal to the whole rows' in one process."""
    B, L, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    cd = accumulation_dtype(v.dtype)
    o, finals = chunk_linear_attn(*(segments.flatten(x) for x in (q, k, v)), scale=scale, output_final_state=True,
                                  chunk_size=chunk_size, cu_seqlens=segments.cu_seqlens)
    o = o.view(B, L, H, V).to(cd)
    key_sums = sequence_cumsum(segments.flatten(k.to(cd)), segments.cu_seqlens).view(B, L, H, K)
    offset = torch.cat([finals[segments.last_segment].to(cd), key_sums[:, -1, ..., None]], -1)  # [B, H, K, V + 1]
    uncut = (~segments.cut).to(cd)[:, None, None, None]
    incoming = segments.context.incoming(uncut, offset, lambda a, s: a * s)
    incoming = incoming * (segments.head > 0).to(cd)[:, None, None, None]
    head = (torch.arange(L, device=q.device) < segments.head[:, None]).to(cd)[..., None, None]  # [B, L, 1, 1]
    qs = scale * q.to(cd)
    o = o + head * torch.einsum("blhk,bhkv->blhv", qs, incoming[..., :V])
    if normalize:
        key_sums = key_sums + head * incoming[:, None, ..., V]
        o = o / ((qs * key_sums).sum(-1, keepdim=True) + eps)
    return o.to(v.dtype)
