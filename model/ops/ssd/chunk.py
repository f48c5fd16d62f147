"""The SSD's chunked form, for training and prefill (the recurrence and its layouts: model/ops/ssd).

On CUDA tensors, when fla imports, the recurrence runs in fla's chunk_simple_gla Triton kernel
(q = C, k = B repeated to the H heads, v = dt x, g = dt A, state [V, K] = [P, N]; cu_seqlens passed to it).
mamba_ssm's mamba_chunk_scan_combined is the other kernel for it, but its PyPI release is a source package whose
build downloads a prebuilt wheel from outside PyPI or compiles CUDA, and it pins Mamba-3's deps.

With allow_neg_eigval (a_t in (-1, 1)): both chunked paths work in log space, so the sign is carried apart: with
G_t = sum_{l <= t} log|a_l| and S_t = (-1)^(number of a_l < 0, l <= t) (counted from each sequence's start),
    prod_{s < l <= t} a_l = S_t S_s exp(G_t - G_s),
so the positive-decay scan with log-decay log|a| runs on v_s = S_s dt_s x_s, its output is multiplied by
S_t and its final state by S_T (the initial state's term, S_t exp(G_t) C_t h_0, comes out right too).
The same kernel (fla's or ours) runs with the option on; the signs cost elementwise products.
"""
import torch
import torch.nn.functional as F

from model.ops.kernels import accumulation_dtype, kernel_runs, optional_kernel, own_precision, repeat_heads
from model.ops.linear_attention.chunk import FLA_CHUNK_SIZE, chunk_flops_per_token, chunk_scalar_decay
from model.ops.varlen import sequence_cumsum


def discretise(x, dt, A, dt_bias, dt_softplus):
    """(x, dt, A) in the compute dtype, with dt biased and softplus'd as asked."""
    ct = accumulation_dtype(x.dtype)
    dt = dt.to(ct)
    if dt_bias is not None:
        dt = dt + dt_bias.to(ct)
    if dt_softplus:
        dt = F.softplus(dt)
    return x.to(ct), dt, A.to(ct)


def log_transition(dt, A, allow_neg_eigval: bool):
    """(log|a_t|, a_t < 0 or None): a_t = exp(dt A), or 2 exp(dt A) - 1 with allow_neg_eigval (|a_t| floored
    at sqrt(eps): model/ops/ssd)."""
    if not allow_neg_eigval:
        return dt * A, None
    a = 2 * torch.exp(dt * A) - 1
    floor = torch.finfo(a.dtype).eps ** 0.5
    return a.abs().clamp_min(floor).log(), a < 0


def skip_and_gate(y, x, D, z):
    """y + D x, then * silu(z) (mamba_ssm's combined kernel order)."""
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D).to(y.dtype)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


@own_precision
def mamba_chunk_scan(x, dt, A, B, C, chunk_size: int, D=None, z=None, dt_bias=None,
                     dt_softplus: bool = False, initial_states=None, return_final_states: bool = False,
                     cu_seqlens=None, allow_neg_eigval: bool = False):
    """SSD over a sequence (model/ops/ssd). Returns y [B, T, H, P] in x's dtype, and with
    return_final_states also the final state [B, H, P, N] ([N_seq, H, P, N] with cu_seqlens) in fp32
    (float64 for float64 inputs)."""
    xc, dt, A = discretise(x, dt, A, dt_bias, dt_softplus)
    ct = xc.dtype
    g, negative = log_transition(dt, A, allow_neg_eigval)
    v = xc * dt[..., None]
    if negative is not None:  # S_t = (-1)^(negatives so far in the sequence): v_s <- S_s v_s (module docstring)
        flips = negative.long().cumsum(1) if cu_seqlens is None else sequence_cumsum(negative.long(), cu_seqlens)
        signs = (1 - 2 * (flips % 2)).to(ct)  # S_t, [B, T, H]
        v = v * signs[..., None]
    kernel = optional_kernel("fla.ops.simple_gla", "chunk_simple_gla", x)
    if kernel is not None:  # its own chunk size (64); q, k, v in x's dtype, g and the state in fp32
        q, k = (repeat_heads(t, x.shape[2]).to(x.dtype) for t in (C, B))
        y, state = kernel(q, k, v.to(x.dtype), g=g, scale=1.0,
                          initial_state=None if initial_states is None else initial_states.to(ct),
                          output_final_state=return_final_states, state_v_first=True,
                          cu_seqlens=cu_seqlens)
        y, state = y.to(ct), (None if state is None else state.to(ct))
    else:
        h0 = None if initial_states is None else initial_states.to(ct).transpose(-1, -2)  # -> [B, H, N, P]
        y, state = chunk_scalar_decay(C.to(ct), B.to(ct), v, g, 1.0, chunk_size, h0, cu_seqlens)
        state = state.transpose(-1, -2)
    if negative is not None:  # y_t <- S_t y_t; the final state <- S_T at each sequence's last token
        y = y * signs[..., None]
        if state is not None:
            last = signs[:, -1] if cu_seqlens is None else signs[0, cu_seqlens[1:] - 1]
            state = state * last[..., None, None]
    y = skip_and_gate(y, xc, D, z).to(x.dtype)
    return (y, state) if return_final_states else y


def mamba_chunk_scan_flops(seq_len: int, chunk_size: int, groups: int, heads: int, head_dim: int, state_size: int,
                           device) -> float:
    """Forward FLOPs per token of mamba_chunk_scan's scan on `device` (the D skip and gate not included): fla's
    chunk_simple_gla where it runs (CUDA), at its chunk, with sequential states and B, C repeated to the H heads
    (so C B^T per head); else chunk_scalar_decay at min(chunk_size, seq_len), C B^T per group."""
    if kernel_runs("fla.ops.simple_gla", device):
        return chunk_flops_per_token(seq_len, FLA_CHUNK_SIZE, heads, heads, state_size, head_dim, sequential_states=True)
    return chunk_flops_per_token(seq_len, min(chunk_size, seq_len), groups, heads, state_size, head_dim)
