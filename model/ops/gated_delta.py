"""Gated delta rule (Gated DeltaNet) and the derived-GDN recursion, in PyTorch.

Recurrence per head, state h [K, V]:
    h_t = h_{t-1} exp(g_t);  u_t = beta_t (v_t - h_t^T k_t);  h_t = h_t + k_t u_t^T;  o_t = h_t^T (scale q_t)
i.e. S_t = S_{t-1} alpha_t (I - beta_t k_t k_t^T) + beta_t v_t k_t^T with S = h^T, alpha = exp(g).

Layouts follow fla: q, k [B, T, H, K], v [B, T, H, V], g (log decay), beta [B, T, H], state [B, H, K, V].
All arithmetic is in fp32 (fp64 for fp64 inputs); outputs are cast back to the input dtype, states
stay in the compute dtype. On CUDA tensors the fla kernels are used when fla imports.
"""
import torch
import torch.nn.functional as F


def _fla(name: str):
    """fla.ops.gated_delta_rule.<name>, or None when fla (or Triton) is not importable."""
    try:
        import fla.ops.gated_delta_rule as fla_gdr
    except ImportError:
        return None
    return getattr(fla_gdr, name)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           chunk_size=64):
    """Chunked (WY) gated delta rule; returns (o [B, T, H, V], final state [B, H, K, V] or None).

    Per chunk of C tokens with in-chunk cumulative log decay G and Gamma_ij = exp(G_i - G_j) (i >= j):
        (I + strictLower(diag(beta) (Gamma o K K^T))) [u | w] = [beta v | beta k exp(G)]
        S_{n+1} = (exp(G_C) I - kd^T w) S_n + kd^T u,   kd = k exp(G_C - G)   (state h, [K, V])
        o = (q exp(G)) S_n + tril(Gamma o Q K^T) (u - w S_n)
    All chunks' intra-chunk work is batched; only the state recursion S_n -> S_{n+1} loops.
    """
    if q.is_cuda:
        fla_chunk = _fla("chunk_gated_delta_rule")
        if fla_chunk is not None:
            return fla_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state)
    B, T, H, K = k.shape
    V = v.shape[-1]
    dtype, cd = v.dtype, _compute_dtype(v)
    scale = K ** -0.5 if scale is None else scale
    C = min(chunk_size, T)
    pad = (C - T % C) % C  # padded steps have k = 0, beta = 0, g = 0: they leave the state unchanged
    N = (T + pad) // C

    def chunks(x):  # [B, T, H, *] -> [N, B, H, C, *], contiguous (chunk index leading for the recursion)
        x = F.pad(x.to(cd), (0, 0) * (x.dim() - 2) + (0, pad))
        x = x.view(B, N, C, H, *x.shape[3:]).transpose(0, 1).transpose(2, 3)
        return x.contiguous()

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    G = g.cumsum(-1)  # [N, B, H, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    gamma = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    # The solve reads only the strict lower triangle (unit diagonal implied).
    akk = (kb @ k.transpose(-1, -2)) * gamma
    rhs = torch.cat([v * beta[..., None], kb * G[..., None].exp()], dim=-1)
    uw = torch.linalg.solve_triangular(akk, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :V], uw[..., V:]
    kdT = (k * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2)
    eye = torch.eye(K, dtype=cd, device=q.device)
    trans = (G[..., -1, None, None].exp() * eye - kdT @ w).view(N, B * H, K, K)
    write = (kdT @ u).view(N, B * H, K, V)

    S = q.new_zeros(B * H, K, V) if initial_state is None else initial_state.to(cd).reshape(B * H, K, V)
    states = []
    for trans_n, write_n in zip(trans.unbind(0), write.unbind(0)):
        states.append(S)
        S = torch.baddbmm(write_n, trans_n, S)
    S_prev = torch.stack(states).view(N, B, H, K, V)  # state entering each chunk
    S = S.view(B, H, K, V)
    q = q * scale
    aqk = (q @ k.transpose(-1, -2)) * gamma
    o = (q * G[..., None].exp()) @ S_prev + aqk @ (u - w @ S_prev)
    o = o.permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(dtype), (S if output_final_state else None)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                     output_final_state=False):
    """The per-token recurrence (for decoding, T small); same arguments and returns as the chunked form."""
    if q.is_cuda:
        fla_rec = _fla("fused_recurrent_gated_delta_rule")
        if fla_rec is not None:
            return fla_rec(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state)
    B, T, H, K = k.shape
    V = v.shape[-1]
    dtype, cd = v.dtype, _compute_dtype(v)
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = q.to(cd) * scale, k.to(cd), v.to(cd), g.to(cd), beta.to(cd)
    h = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(cd)
    out = []
    for t in range(T):
        h = h * g[:, t, :, None, None].exp()
        u = beta[:, t, :, None] * (v[:, t] - (h * k[:, t, :, :, None]).sum(-2))
        h = h + k[:, t, :, :, None] * u[:, :, None, :]
        out.append((h * q[:, t, :, :, None]).sum(-2))
    return torch.stack(out, dim=1).to(dtype), (h if output_final_state else None)


def derived_gated_delta_rule(q, k, v, scale=None, initial_state=None, output_final_state=False,
                             clamp_ktil=False):
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
    no step amplifies; False is (3) exactly.

    State (initial_state / returned): dict with A [B, H, K, V] (A_t transposed, the gated-delta h),
    k_sum [B, H, K] and v_sum [B, H, V] (running sums of scaled keys and of values), t (int, tokens seen).
    Returns (o [B, T, H, V], state or None).
    """
    B, T, H, K = k.shape
    dtype, cd = v.dtype, _compute_dtype(v)
    root = (K ** -0.5 if scale is None else scale) ** 0.5
    q, k, v = q.to(cd) * root, k.to(cd) * root, v.to(cd)
    t0 = 0 if initial_state is None else initial_state["t"]
    t = torch.arange(t0 + 1, t0 + T + 1, dtype=cd, device=q.device)[None, :, None]  # [1, T, 1]
    k_sum, v_sum = k.cumsum(1), v.cumsum(1)
    if initial_state is not None:
        k_sum = k_sum + initial_state["k_sum"].to(cd)[:, None]
        v_sum = v_sum + initial_state["v_sum"].to(cd)[:, None]
    ktil = k - k_sum / t[..., None]
    vbar = v_sum / t[..., None]
    vtil = v - (v_sum - v) / (t - 1).clamp(min=1)[..., None]  # vbar_0 = 0
    if clamp_ktil:
        ktil = ktil * (ktil.pow(2).sum(-1) / (2 * t - 1)).clamp(min=1).rsqrt()[..., None]
    first = t == 1
    g = torch.where(first, 0.0, torch.log1p(-1 / t)).expand(B, T, H)
    beta = torch.where(first, 0.0, 1 / (t - 1).clamp(min=1)).expand(B, T, H)
    A0 = None if initial_state is None else initial_state["A"]
    o, A = chunk_gated_delta_rule(q, ktil, vtil * ((t - 1) / t)[..., None], g, beta, scale=1.0,
                                  initial_state=A0, output_final_state=output_final_state)
    o = (o.to(cd) + vbar).to(dtype)
    if not output_final_state:
        return o, None
    return o, {"A": A, "k_sum": k_sum[:, -1], "v_sum": v_sum[:, -1], "t": t0 + T}


def chunk_gated_delta_flops(head_k_dim: int, head_v_dim: int, chunk_size: int = 64) -> float:
    """Forward FLOPs per token per head of chunk_gated_delta_rule (2 per multiply-add): k k^T and q k^T
    (C K each), the triangular solve (C (K + V) / 2), kd^T w and kd^T u (K^2 + K V), the state
    recursion (K^2 V / C), w S and q S (2 K V), and the intra-chunk product (C V)."""
    K, V, C = head_k_dim, head_v_dim, chunk_size
    return 2.0 * (2 * C * K + C * (K + V) / 2 + K * K + 3 * K * V + K * K * V / C + C * V)
