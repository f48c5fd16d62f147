"""The delta rule per token, for decoding (the rule and its layouts: model/ops/gated_delta)."""
import torch

from model.ops.gated_delta.chunk import decay_form
from model.ops.kernels import accumulation_dtype, optional_kernel, own_precision
from model.ops.varlen import check_packed


RECURRENT_KERNELS = {"none": ("fla.ops.delta_rule", "fused_recurrent_delta_rule"),
                     "per_head": ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
                     "per_channel": ("fla.ops.kda", "fused_recurrent_kda")}



@own_precision
def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                     output_final_state=False, cu_seqlens=None):
    """The per-token recurrence (for decoding, T small); same arguments and returns as the chunked form."""
    fla_rec = optional_kernel(*RECURRENT_KERNELS[decay_form(k, g)], q)
    if fla_rec is not None:
        # keywords: fla's GDN signature is (q, k, v, g, gk, gv, beta, ...); DeltaNet's has no g
        return fla_rec(q, k, v, beta=beta, **({} if g is None else {"g": g}), scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if cu_seqlens is not None:
        check_packed(q, cu_seqlens, initial_state)
        bounds = cu_seqlens.tolist()
        parts = [fused_recurrent_gated_delta_rule(*(None if x is None else x[:, a:b] for x in (q, k, v, g, beta)),
                                                  scale=scale, output_final_state=True)
                 for a, b in zip(bounds, bounds[1:])]
        o = torch.cat([o for o, _ in parts], dim=1)
        return o, (torch.cat([h for _, h in parts]) if output_final_state else None)
    B, T, H, K = k.shape
    V = v.shape[-1]
    dtype, cd = v.dtype, accumulation_dtype(v.dtype)
    scale = K ** -0.5 if scale is None else scale
    q, k, v, beta = q.to(cd) * scale, k.to(cd), v.to(cd), beta.to(cd)
    h = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(cd)
    out = []
    for t in range(T):
        if g is not None:
            h = h * _state_decay(g[:, t].to(cd))
        u = beta[:, t, :, None] * (v[:, t] - (h * k[:, t, :, :, None]).sum(-2))
        h = h + k[:, t, :, :, None] * u[:, :, None, :]
        out.append((h * q[:, t, :, :, None]).sum(-2))
    return torch.stack(out, dim=1).to(dtype), (h if output_final_state else None)


def _state_decay(g_t: torch.Tensor) -> torch.Tensor:
    """exp(g_t) shaped to scale a state [B, H, K, V]: g_t [B, H] (per head) or [B, H, K] (per key channel)."""
    return g_t.reshape(*g_t.shape[:2], -1, 1).exp()


