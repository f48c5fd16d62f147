"""SSD (Mamba2's state-space duality) scan, in PyTorch, with mamba_ssm's mamba_chunk_scan_combined layouts.

Per head h (group g = h // (H / G)), state h_t [P, N]:
    dt_t = softplus(dt_t + dt_bias) if dt_softplus else dt_t (+ dt_bias)
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,    y_t = h_t C_t + D x_t,    y_t <- y_t * silu(z_t)
x [B, T, H, P], dt [B, T, H], A [H], B, C [B, T, G, N], D [H] or [H, P], z [B, T, H, P],
state [B, H, P, N]. This is linear attention with a scalar decay (q = C, k = B, v = dt x,
log-decay dt A, scale 1), so the chunked form is model/ops/linear_attention's chunk_scalar_decay.
cu_seqlens (fla's convention, model/ops/varlen.py): a batch-1 row of several sequences, each starting
from a zero state.

allow_neg_eigval (Grazzi et al. 2025, "Unlocking State-Tracking in Linear RNNs Through Negative
Eigenvalues", ICLR): the transition a_t = exp(dt_t A) in (0, 1) becomes a_t = 2 exp(dt_t A) - 1 in
(-1, 1); the input term dt_t x_t B_t^T is unchanged (the chunked form carries the sign apart: chunk.py).
|a_t| is floored at sqrt(eps) of the compute dtype (fp32: 3.5e-4), in every path, the decoding step
included: the gradient reaches a_t through d log|a| / da = 1 / a, which turns the rounding error of the
log-space scan's gradient (eps relative) into eps / |a|; the floor keeps it below sqrt(eps), and changes
the state by at most sqrt(eps) |h|.

The forms, as fla lays an op out: chunk.py (chunked, training and prefill), recurrent.py (one step, decoding),
naive.py (the float64 oracle), context_parallel.py (one sequence across ranks).
"""
from model.ops.ssd.chunk import mamba_chunk_scan, mamba_chunk_scan_flops
from model.ops.ssd.naive import naive_ssd
from model.ops.ssd.recurrent import mamba_state_step
