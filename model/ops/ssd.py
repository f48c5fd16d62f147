"""SSD (Mamba2's state-space duality) scan, with mamba_ssm's mamba_chunk_scan_combined layouts.

Per head h (group g = h // (H / G)), state h_t [P, N]:
    dt_t = softplus(dt_t + dt_bias) if dt_softplus else dt_t (+ dt_bias)
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,    y_t = h_t C_t + D x_t,    y_t <- y_t * silu(z_t)
x [B, T, H, P], dt [B, T, H], A [H], B, C [B, T, G, N], D [H] or [H, P], z [B, T, H, P],
state [B, H, P, N]. This is linear attention with a scalar decay (q = C, k = B, v = dt x,
log-decay dt A, scale 1), so the chunked form is linear_attention.chunk_scalar_decay.
On CUDA tensors, when fla imports, that same recurrence runs in fla's chunk_simple_gla Triton kernel
(q = C, k = B repeated to the H heads, v = dt x, g = dt A, state [V, K] = [P, N]). mamba_ssm's
mamba_chunk_scan_combined is the other kernel for it, but its PyPI release is a source package whose
build downloads a prebuilt wheel from outside PyPI or compiles CUDA, and it pins Mamba-3's deps.
cu_seqlens (fla's convention, model/ops/varlen.py; passed to the kernel on CUDA): a batch-1 row of
several sequences, each starting from a zero state.

allow_neg_eigval (Grazzi et al. 2025, "Unlocking State-Tracking in Linear RNNs Through Negative
Eigenvalues", ICLR): the transition a_t = exp(dt_t A) in (0, 1) becomes a_t = 2 exp(dt_t A) - 1 in
(-1, 1); the input term dt_t x_t B_t^T is unchanged. Both chunked paths work in log space, so the sign
is carried apart: with G_t = sum_{l <= t} log|a_l| and S_t = (-1)^(number of a_l < 0, l <= t) (counted
from each sequence's start),
    prod_{s < l <= t} a_l = S_t S_s exp(G_t - G_s),
so the positive-decay scan with log-decay log|a| runs on v_s = S_s dt_s x_s, its output is multiplied by
S_t and its final state by S_T (the initial state's term, S_t exp(G_t) C_t h_0, comes out right too).
The same kernel (fla's or ours) runs with the option on; the signs cost elementwise products.
|a_t| is floored at sqrt(eps) of the compute dtype (fp32: 3.5e-4), in every path, the decoding step
included: the gradient reaches a_t through d log|a| / da = 1 / a, which turns the rounding error of the
log-space scan's gradient (eps relative) into eps / |a|; the floor keeps it below sqrt(eps), and changes
the state by at most sqrt(eps) |h|.
"""
import torch
import torch.nn.functional as F

from model.ops.kernels import accumulation_dtype, kernel_runs, optional_kernel, own_precision, repeat_heads
from model.ops.linear_attention import FLA_CHUNK_SIZE, chunk_flops_per_token, chunk_scalar_decay
from model.ops.varlen import sequence_cumsum


def _discretise(x, dt, A, dt_bias, dt_softplus):
    """(x, dt, A) in the compute dtype, with dt biased and softplus'd as asked."""
    ct = accumulation_dtype(x.dtype)
    dt = dt.to(ct)
    if dt_bias is not None:
        dt = dt + dt_bias.to(ct)
    if dt_softplus:
        dt = F.softplus(dt)
    return x.to(ct), dt, A.to(ct)


def _log_transition(dt, A, allow_neg_eigval: bool):
    """(log|a_t|, a_t < 0 or None): a_t = exp(dt A), or 2 exp(dt A) - 1 with allow_neg_eigval (|a_t| floored
    at sqrt(eps), module docstring)."""
    if not allow_neg_eigval:
        return dt * A, None
    a = 2 * torch.exp(dt * A) - 1
    floor = torch.finfo(a.dtype).eps ** 0.5
    return a.abs().clamp_min(floor).log(), a < 0


def _skip_and_gate(y, x, D, z):
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
    """SSD over a sequence (see module docstring). Returns y [B, T, H, P] in x's dtype, and with
    return_final_states also the final state [B, H, P, N] ([N_seq, H, P, N] with cu_seqlens) in fp32
    (float64 for float64 inputs)."""
    xc, dt, A = _discretise(x, dt, A, dt_bias, dt_softplus)
    ct = xc.dtype
    g, negative = _log_transition(dt, A, allow_neg_eigval)
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
    y = _skip_and_gate(y, xc, D, z).to(x.dtype)
    return (y, state) if return_final_states else y


def mamba_chunk_scan_flops(seq_len: int, chunk_size: int, groups: int, heads: int, head_dim: int, state_size: int,
                           device) -> float:
    """Forward FLOPs per token of mamba_chunk_scan's scan on `device` (the D skip and gate not included): fla's
    chunk_simple_gla where it runs (CUDA), at its chunk, with sequential states and B, C repeated to the H heads
    (so C B^T per head); else chunk_scalar_decay at min(chunk_size, seq_len), C B^T per group."""
    if kernel_runs("fla.ops.simple_gla", device):
        return chunk_flops_per_token(seq_len, FLA_CHUNK_SIZE, heads, heads, state_size, head_dim, sequential_states=True)
    return chunk_flops_per_token(seq_len, min(chunk_size, seq_len), groups, heads, state_size, head_dim)


@own_precision
def mamba_state_step(x, dt, A, B, C, state, D=None, z=None, dt_bias=None, dt_softplus: bool = False,
                     allow_neg_eigval: bool = False):
    """One decoding step of the same recurrence: x [B, H, P], dt [B, H], B, C [B, G, N],
    state [B, H, P, N]. Returns (y [B, H, P] in x's dtype, new state in the compute dtype)."""
    xc, dt, A = _discretise(x, dt, A, dt_bias, dt_softplus)
    ct = xc.dtype
    B, C = (repeat_heads(t.to(ct), x.shape[1], dim=1) for t in (B, C))  # [B, H, N]
    g, negative = _log_transition(dt, A, allow_neg_eigval)
    a = g.exp() if negative is None else torch.where(negative, -g.exp(), g.exp())
    # h = a h + (dt x) B^T;  y = h C
    state = state.to(ct) * a[..., None, None] + (dt[..., None] * xc)[..., None] * B[:, :, None, :]
    y = (state @ C[..., None]).squeeze(-1)
    return _skip_and_gate(y, xc, D, z).to(x.dtype), state


# ---- naive reference: the recurrence token by token, straight from the formulas (the tests' oracle, float64)
def naive_ssd(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, h0=None, allow_neg_eigval=False):
    """h_t = a_t h_{t-1} + dt_t x_t B_t^T, a_t = exp(dt_t A) (allow_neg_eigval: 2 exp(dt_t A) - 1);
    y_t = h_t C_t + D x_t; y_t *= silu(z_t); per head, head h reading group h // (H / G)."""
    Bsz, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    h = [[torch.zeros(P, N, dtype=x.dtype) if h0 is None else h0[b, i] for i in range(H)] for b in range(Bsz)]
    ys = []
    for b in range(Bsz):
        yb = []
        for t in range(T):
            yt = []
            for i in range(H):
                g = i // (H // G)
                a = torch.exp(dt[b, t, i] * A[i])
                if allow_neg_eigval:
                    a = 2 * a - 1
                h[b][i] = a * h[b][i] + dt[b, t, i] * torch.outer(x[b, t, i], B[b, t, g])
                y = h[b][i] @ C[b, t, g]
                if D is not None:
                    y = y + D[i] * x[b, t, i]
                if z is not None:
                    y = y * F.silu(z[b, t, i])
                yt.append(y)
            yb.append(torch.stack(yt))
        ys.append(torch.stack(yb))
    final = torch.stack([torch.stack(hb) for hb in h])
    return torch.stack(ys), final
