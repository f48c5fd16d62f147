"""The delta rule per token, for decoding (the rule and its layouts: model/ops/gated_delta)."""
import torch

from model.ops.gated_delta.chunk import channel_gates, decay_form, per_channel_gates
from model.ops.kernels import accumulation_dtype, optional_kernel, own_precision
from model.ops.varlen import check_packed


RECURRENT_KERNELS = {"none": ("fla.ops.delta_rule", "fused_recurrent_delta_rule"),
                     "per_head": ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
                     "per_channel": ("fla.ops.kda", "fused_recurrent_kda"),
                     "channel_gates": ("fla.ops.gdn2", "fused_recurrent_gdn2")}


@own_precision
def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                     output_final_state=False, cu_seqlens=None, write=None):
    """The per-token recurrence (for decoding, T small); same arguments and returns as the chunked form:
    u_t = write_t o v_t - h^T (erase_t o k_t) (both beta_t unless GDN-2's gates), h = h + k_t u_t^T."""
    gated = channel_gates(k, v, beta, write)
    fla_rec = optional_kernel(*RECURRENT_KERNELS["channel_gates" if gated else decay_form(k, g)], q)
    if fla_rec is not None and gated:
        g, b, write = per_channel_gates(k, v, g, beta, write)
        return fla_rec(q, k, v, g=g.float(), b=b.expand(k.shape), w=write, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if fla_rec is not None:
        # keywords: fla's GDN signature is (q, k, v, g, gk, gv, beta, ...); DeltaNet's has no g
        return fla_rec(q, k, v, beta=beta, **({} if g is None else {"g": g}), scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if cu_seqlens is not None:
        check_packed(q, cu_seqlens, initial_state)
        bounds = cu_seqlens.tolist()
        parts = [fused_recurrent_gated_delta_rule(*(None if x is None else x[:, a:b] for x in (q, k, v, g, beta)),
                                                  scale=scale, output_final_state=True,
                                                  write=None if write is None else write[:, a:b])
                 for a, b in zip(bounds, bounds[1:])]
        o = torch.cat([o for o, _ in parts], dim=1)
        return o, (torch.cat([h for _, h in parts]) if output_final_state else None)
    B, T, H, K = k.shape
    V = v.shape[-1]
    dtype, cd = v.dtype, accumulation_dtype(v.dtype)
    scale = K ** -0.5 if scale is None else scale
    erase = beta if beta.dim() == 4 else beta[..., None]
    write = beta[..., None] if write is None else write
    q, k, v, erase, write = q.to(cd) * scale, k.to(cd), v.to(cd), erase.to(cd), write.to(cd)
    h = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(cd)
    out = []
    for t in range(T):
        if g is not None:
            h = h * _state_decay(g[:, t].to(cd))
        u = write[:, t] * v[:, t] - (h * (erase[:, t] * k[:, t])[..., None]).sum(-2)
        h = h + k[:, t, :, :, None] * u[:, :, None, :]
        out.append((h * q[:, t, :, :, None]).sum(-2))
    return torch.stack(out, dim=1).to(dtype), (h if output_final_state else None)


def _state_decay(g_t: torch.Tensor) -> torch.Tensor:
    """exp(g_t) shaped to scale a state [B, H, K, V]: g_t [B, H] (per head) or [B, H, K] (per key channel)."""
    return g_t.reshape(*g_t.shape[:2], -1, 1).exp()


