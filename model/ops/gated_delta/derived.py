"""Derived GDN: softmax attention linearized into a gated delta rule with fixed 1/t gates (docs/blocks.md)."""
import torch

from model.ops.gated_delta.chunk import chunk_gated_delta_rule
from model.ops.kernels import accumulation_dtype, own_precision
from model.ops.varlen import check_packed, positions_in_sequences, sequence_cumsum


@own_precision
def derived_gated_delta_rule(q, k, v, scale=None, initial_state=None, output_final_state=False,
                             clamp_ktil=False, cu_seqlens=None):
    """Softmax attention linearized into a gated delta rule with fixed 1/t gates (derived GDN):

        kbar_t = mean(k_1..k_t), vbar_t = mean(v_1..v_t), ktil_t = k_t - kbar_t, vtil_t = v_t - vbar_{t-1}
        A_t = A_{t-1} ((1 - 1/t) I - (1/t) ktil_t ktil_t^T) + (1/t) vtil_t ktil_t^T,   A_0 = 0, vbar_0 = 0
        o_t = A_t q_t + vbar_t

    computed as chunk_gated_delta_rule with keys ktil_t, alpha_t = 1 - 1/t, beta_t = 1/(t-1) and written
    value vtil_t (t-1)/t (at t = 1, ktil_1 = 0 so A_1 = 0: alpha = 1, beta = 0 there).
    q and k are each multiplied by scale^1/2 (default scale = K^-1/2, the softmax logit scale split
    symmetrically); scale=1.0 uses them as given.

    Along ktil_t the transition has eigenvalue 1 - (1 + |ktil_t|^2)/t, which amplifies the state when
    |ktil_t|^2 > 2t - 1. clamp_ktil=True rescales ktil_t (in both its uses) to |ktil_t|^2 <= 2t - 1 so that
    no step amplifies; False is the recursion above exactly.

    State (initial_state / returned): dict with A [B, H, K, V] (A_t transposed, the gated-delta h),
    k_sum [B, H, K] and v_sum [B, H, V] (running sums of scaled keys and of values), t (int, tokens seen).
    Returns (o [B, T, H, V], state or None). With cu_seqlens (batch 1) t, the sums and A restart at
    each sequence; the state then holds one entry per sequence and t is their lengths [N].
    The means, ktil and vtil are computed in fp32 (fp64 for fp64 inputs); the gated delta rule then
    takes q, ktil and the written value in the input dtype, as GDN's kernel call does.
    """
    B, T, H, K = k.shape
    dtype, cd = v.dtype, accumulation_dtype(v.dtype)
    root = (K ** -0.5 if scale is None else scale) ** 0.5
    q, k, v = q.to(cd) * root, k.to(cd) * root, v.to(cd)
    t0 = 0 if initial_state is None else initial_state["t"]  # an int, or per row [B]
    if cu_seqlens is None:
        t = torch.arange(1, T + 1, dtype=cd, device=q.device)[None, :, None]  # [1, T, 1]
        t = t + (t0 if isinstance(t0, int) else t0.to(cd)[:, None, None])
        k_sum, v_sum = k.cumsum(1), v.cumsum(1)
    else:
        check_packed(q, cu_seqlens, initial_state)
        t = (positions_in_sequences(cu_seqlens) + 1).to(cd)[None, :, None]
        k_sum, v_sum = sequence_cumsum(k, cu_seqlens), sequence_cumsum(v, cu_seqlens)
    if initial_state is not None:
        k_sum = k_sum + initial_state["k_sum"].to(cd)[:, None]
        v_sum = v_sum + initial_state["v_sum"].to(cd)[:, None]
    ktil, vbar, written, g, beta = derived_inputs(k, v, k_sum, v_sum, t, clamp_ktil)
    A0 = None if initial_state is None else initial_state["A"]
    # the rule's q, k, v in the input dtype (bf16 under autocast: the kernel's), g and beta in fp32
    o, A = chunk_gated_delta_rule(q.to(dtype), ktil.to(dtype), written.to(dtype), g, beta, scale=1.0,
                                  initial_state=A0, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    o = (o.to(cd) + vbar).to(dtype)
    if not output_final_state:
        return o, None
    if cu_seqlens is not None:
        last = cu_seqlens[1:] - 1
        return o, {"A": A, "k_sum": k_sum[0, last], "v_sum": v_sum[0, last], "t": cu_seqlens.diff()}
    return o, {"A": A, "k_sum": k_sum[:, -1], "v_sum": v_sum[:, -1], "t": t0 + T}


def derived_inputs(k, v, k_sum, v_sum, t, clamp_ktil: bool):
    """The gated delta rule's inputs in derived GDN at each token's t [.., T, 1] (its place in its sequence, from 1),
    from the scaled keys and values k, v [B, T, H, *] and their running sums to t: (ktil, vbar_t, the written value
    vtil (t - 1) / t, g = log(1 - 1/t), beta = 1/(t - 1)), with alpha = 1, beta = 0 at t = 1."""
    B, T, H = k.shape[:3]
    ktil = k - k_sum / t[..., None]
    vbar = v_sum / t[..., None]
    vtil = v - (v_sum - v) / (t - 1).clamp(min=1)[..., None]  # vbar_0 = 0
    if clamp_ktil:
        ktil = ktil * (ktil.pow(2).sum(-1) / (2 * t - 1)).clamp(min=1).rsqrt()[..., None]
    first = t == 1
    g = torch.where(first, 0.0, torch.log1p(-1 / t)).expand(B, T, H)
    beta = torch.where(first, 0.0, 1 / (t - 1).clamp(min=1)).expand(B, T, H)
    return ktil, vbar, vtil * ((t - 1) / t)[..., None], g, beta


