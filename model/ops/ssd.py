"""SSD (Mamba2's state-space duality) scan, with mamba_ssm's mamba_chunk_scan_combined layouts.

Per head h (group g = h // (H / G)), state h_t [P, N]:
    dt_t = softplus(dt_t + dt_bias) if dt_softplus else dt_t (+ dt_bias)
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,    y_t = h_t C_t + D x_t,    y_t <- y_t * silu(z_t)
x [B, T, H, P], dt [B, T, H], A [H], B, C [B, T, G, N], D [H] or [H, P], z [B, T, H, P],
state [B, H, P, N]. This is linear attention with a scalar decay (q = C, k = B, v = dt x,
log-decay dt A, scale 1), so the chunked form is linear_attention.chunk_scalar_decay.
On CUDA tensors, when mamba_ssm imports, its fused Triton kernel runs instead. cu_seqlens (fla's
convention, model/ops/varlen.py; mamba_ssm's seq_idx on CUDA): a batch-1 row of several sequences,
each starting from a zero state.
"""
import torch
import torch.nn.functional as F

from model.ops.linear_attention import chunk_scalar_decay, compute_dtype
from model.ops.varlen import sequence_ids


def _mamba_kernel():
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as kernel
    except ImportError:
        return None
    return kernel


def _discretise(x, dt, A, dt_bias, dt_softplus):
    """(x, dt, A) in the compute dtype, with dt biased and softplus'd as asked."""
    ct = compute_dtype(x.dtype)
    dt = dt.to(ct)
    if dt_bias is not None:
        dt = dt + dt_bias.to(ct)
    if dt_softplus:
        dt = F.softplus(dt)
    return x.to(ct), dt, A.to(ct)


def _skip_and_gate(y, x, D, z):
    """y + D x, then * silu(z) (mamba_ssm's combined kernel order)."""
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D).to(y.dtype)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


def mamba_chunk_scan(x, dt, A, B, C, chunk_size: int, D=None, z=None, dt_bias=None,
                     dt_softplus: bool = False, initial_states=None, return_final_states: bool = False,
                     cu_seqlens=None):
    """SSD over a sequence (see module docstring). Returns y [B, T, H, P] in x's dtype, and with
    return_final_states also the final state [B, H, P, N] ([N_seq, H, P, N] with cu_seqlens) in fp32
    (float64 for float64 inputs)."""
    kernel = _mamba_kernel() if x.is_cuda else None
    if kernel is not None and cu_seqlens is not None:  # seq_idx resets the state; varlen states are per sequence
        seq_idx = sequence_ids(cu_seqlens)[None].to(torch.int32)
        return kernel(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                      seq_idx=seq_idx, cu_seqlens=cu_seqlens, dt_softplus=dt_softplus,
                      return_varlen_states=return_final_states)
    if kernel is not None:
        return kernel(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                      dt_softplus=dt_softplus, return_final_states=return_final_states)
    xc, dt, A = _discretise(x, dt, A, dt_bias, dt_softplus)
    ct = xc.dtype
    h0 = None if initial_states is None else initial_states.to(ct).transpose(-1, -2)  # -> [B, H, N, P]
    y, state = chunk_scalar_decay(C.to(ct), B.to(ct), xc * dt[..., None], dt * A, 1.0, chunk_size, h0, cu_seqlens)
    y = _skip_and_gate(y, xc, D, z).to(x.dtype)
    return (y, state.transpose(-1, -2)) if return_final_states else y


def mamba_state_step(x, dt, A, B, C, state, D=None, z=None, dt_bias=None, dt_softplus: bool = False):
    """One decoding step of the same recurrence: x [B, H, P], dt [B, H], B, C [B, G, N],
    state [B, H, P, N]. Returns (y [B, H, P] in x's dtype, new state in the compute dtype)."""
    xc, dt, A = _discretise(x, dt, A, dt_bias, dt_softplus)
    ct = xc.dtype
    heads_per_group = x.shape[1] // B.shape[1]
    B = B.to(ct).repeat_interleave(heads_per_group, dim=1)  # [B, H, N]
    C = C.to(ct).repeat_interleave(heads_per_group, dim=1)
    # h = exp(dt A) h + (dt x) B^T;  y = h C
    state = state.to(ct) * (dt * A).exp()[..., None, None] + (dt[..., None] * xc)[..., None] * B[:, :, None, :]
    y = (state @ C[..., None]).squeeze(-1)
    return _skip_and_gate(y, xc, D, z).to(x.dtype), state
