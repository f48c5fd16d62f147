"""Causal softmax attention's context-parallel form: one slice's queries over the keys up to its end, on CPU, without
a mask (model/mixers/softmax.py's; the keys and values come from ContextGroup.gather, model/ops/context_parallel.py).

The L queries sit at the last L positions of S keys; the earlier S - L keys are all visible to every query, the
last L causally. SDPA would need a dense [L, S] mask, which it turns into floats and keeps for the backward
(L S numbers per layer: more than the rest of a long slice's activations). Instead, two of torch's CPU flash
attention calls, one per block of keys, are merged by their log-sum-exps (ring attention's merge):
    o = o_1 e^{lse_1 - lse} + o_2 e^{lse_2 - lse},  lse = log(e^{lse_1} + e^{lse_2}),
and the backward runs each block's flash backward with the merged o and lse (the softmax over all S keys), so
memory stays O(L) as in one process's causal attention. Rows with several documents need their mask and take
SDPA's masked path, as one process does; CUDA takes FlexAttention's block mask either way.
"""
import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _EarlierThenCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):
        start = k.shape[2] - q.shape[2]
        o1, lse1 = _flash(q, k[:, :, :start], v[:, :, :start], 0.0, False, scale=scale)
        o2, lse2 = _flash(q, k[:, :, start:], v[:, :, start:], 0.0, True, scale=scale)
        lse = torch.logaddexp(lse1, lse2)
        o = o1 * (lse1 - lse).exp()[..., None].to(o1.dtype) + o2 * (lse2 - lse).exp()[..., None].to(o2.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.start = scale, start
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        s, do = ctx.start, do.contiguous()
        dq1, dk1, dv1 = _flash_backward(do, q, k[:, :, :s], v[:, :, :s], o, lse, 0.0, False, scale=ctx.scale)
        dq2, dk2, dv2 = _flash_backward(do, q, k[:, :, s:], v[:, :, s:], o, lse, 0.0, True, scale=ctx.scale)
        return dq1 + dq2, torch.cat([dk1, dk2], 2), torch.cat([dv1, dv2], 2), None


def causal_attention_after(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention o [B, H, L, D] of q [B, H, L, D] at the last L of the S positions of k, v [B, Hkv, S, D]
    (grouped heads repeated to H), on CPU tensors."""
    H = q.shape[1]
    k, v = (x.repeat_interleave(H // x.shape[1], dim=1) if x.shape[1] != H else x for x in (k, v))
    if k.shape[2] == q.shape[2]:  # no earlier keys (rank 0)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return _EarlierThenCausal.apply(q.contiguous(), k.contiguous().to(q.dtype), v.contiguous().to(q.dtype), scale)
