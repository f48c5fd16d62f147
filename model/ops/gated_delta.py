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
        S_{n+1} = exp(G_C) S_n + kd^T (u - w S_n),   kd = k exp(G_C - G)   (state h, [K, V])
        o = (q exp(G)) S_n + tril(Gamma o Q K^T) (u - w S_n)
    All chunks' intra-chunk work is batched; only the state recursion S_n -> S_{n+1} loops (and its
    reverse in the hand-written backward).
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

    q, k, v, g, beta = chunks(q) * scale, chunks(k), chunks(v), chunks(g), chunks(beta)
    S0 = q.new_zeros(B * H, K, V) if initial_state is None else initial_state.to(cd).reshape(B * H, K, V)
    o, S = _ChunkedGatedDelta.apply(q, k, v, g.cumsum(-1), beta, S0)
    o = o.permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(dtype), (S.view(B, H, K, V) if output_final_state else None)


class _ChunkedGatedDelta(torch.autograd.Function):
    """The chunked gated delta rule on chunked tensors: q (scaled), k [N, B, H, C, K], v [N, B, H, C, V],
    G (in-chunk cumulative log decay), beta [N, B, H, C], S0 [B H, K, V] -> o [N, B, H, C, V], S_N.

    Forward: u = inv (beta v), w = inv (beta k e^G), inv = (I + strictLower(Gamma o diag(beta) K K^T))^-1;
    per chunk vnew = u - w S, S <- e^{G_C} S + kd^T vnew; then o = (q e^G) S + (Gamma o Q K^T) vnew, batched.
    Backward by hand (autograd through the same graph measured ~1.3x slower on CPU): the matmuls reversed, the
    state gradient in one reverse loop, and d inv folded into dA = -strictLower(inv^T [du | dw] [u | w]^T).
    """

    @staticmethod
    def forward(ctx, q, k, v, G, beta, S0):
        N, B, H, C, K = k.shape
        V = v.shape[-1]
        kT = k.transpose(-1, -2)
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        gamma = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        kb = k * beta[..., None]
        kbk, qk = kb @ kT, q @ kT
        eye = torch.eye(C, dtype=q.dtype, device=q.device).expand(N, B, H, C, C)
        akk, aqk = kbk * gamma, qk * gamma
        inv = torch.linalg.solve_triangular(akk, eye, upper=False, unitriangular=True)  # strict lower read
        eG = G.exp()
        u, w = inv @ (v * beta[..., None]), inv @ (kb * eG[..., None])
        kd = k * (G[..., -1:] - G).exp()[..., None]
        S, states, vnews = S0, [], []
        for u_n, w_n, kd_n, decay_n in zip(u.view(N, B * H, C, V), w.view(N, B * H, C, K),
                                           kd.view(N, B * H, C, K), eG[..., -1].reshape(N, B * H, 1, 1)):
            states.append(S)
            vnews.append(torch.baddbmm(u_n, w_n, S, alpha=-1))
            S = torch.baddbmm(S * decay_n, kd_n.transpose(-1, -2), vnews[-1])
        S_prev = torch.stack(states).view(N, B, H, K, V)  # state entering each chunk
        vnew = torch.stack(vnews).view(N, B, H, C, V)
        o = (q * eG[..., None]) @ S_prev + aqk @ vnew
        ctx.save_for_backward(q, k, v, G, beta, gamma, akk, aqk, inv, u, w, S_prev, vnew)
        return o, S

    @staticmethod
    def backward(ctx, do, dS_last):
        q, k, v, G, beta, gamma, akk, aqk, inv, u, w, S_prev, vnew = ctx.saved_tensors
        N, B, H, C, K = k.shape
        V = v.shape[-1]
        eG, ed = G.exp(), (G[..., -1:] - G).exp()
        kb, qg, kd = k * beta[..., None], q * eG[..., None], k * ed[..., None]
        # o = qg S + aqk vnew
        d_aqk = do @ vnew.transpose(-1, -2)
        d_vnew = aqk.transpose(-1, -2) @ do
        dS_out = (qg.transpose(-1, -2) @ do).view(N, B * H, K, V)
        # per chunk, in reverse: vnew = u - w S,  S' = e^{G_C} S + kd^T vnew
        dS, d_nexts, d_vnew_state = dS_last, [], []  # autograd materialises unused output grads as zeros
        d_vnew_flat = d_vnew.view(N, B * H, C, V)
        for n in range(N - 1, -1, -1):
            d_nexts.append(dS)
            dv_n = torch.baddbmm(d_vnew_flat[n], kd.view(N, B * H, C, K)[n], dS)  # total d vnew_n
            d_vnew_state.append(dv_n)
            dS = torch.baddbmm(dS_out[n] + dS * eG[..., -1].reshape(N, B * H, 1, 1)[n],
                               w.view(N, B * H, C, K)[n].transpose(-1, -2), dv_n, alpha=-1)
        d_next = torch.stack(d_nexts[::-1]).view(N, B, H, K, V)
        du = torch.stack(d_vnew_state[::-1]).view(N, B, H, C, V)
        dw = -du @ S_prev.transpose(-1, -2)
        d_kd = vnew @ d_next.transpose(-1, -2)
        # u = inv vb, w = inv kg
        d_vb, d_kg = inv.transpose(-1, -2) @ du, inv.transpose(-1, -2) @ dw
        dA = -(d_vb @ u.transpose(-1, -2) + d_kg @ w.transpose(-1, -2)).tril(-1)
        # akk = (kb k^T) o gamma, aqk = (q k^T) o gamma, gamma = exp(G_i - G_j)
        d_kbk, d_qk = dA * gamma, d_aqk * gamma
        d_gamma = dA * akk + d_aqk * aqk  # d(G_i - G_j)
        d_kb = d_kbk @ k + d_kg * eG[..., None]
        d_qg = do @ S_prev.transpose(-1, -2)
        dq = d_qk @ k + d_qg * eG[..., None]
        dk = d_kbk.transpose(-1, -2) @ kb + d_qk.transpose(-1, -2) @ q + d_kb * beta[..., None] + d_kd * ed[..., None]
        dv = d_vb * beta[..., None]
        dbeta = (d_vb * v).sum(-1) + (d_kb * k).sum(-1)
        d_ed = (d_kd * kd).sum(-1)  # d(G_C - G)
        dG = d_gamma.sum(-1) - d_gamma.sum(-2) + (d_qg * qg).sum(-1) + (d_kg * kb * eG[..., None]).sum(-1) - d_ed
        d_last = d_ed.sum(-1) + (d_next * S_prev).sum((-1, -2)) * eG[..., -1]
        dG = torch.cat([dG[..., :-1], (dG[..., -1] + d_last)[..., None]], dim=-1)
        return dq, dk, dv, dG, dbeta, dS


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
    """Forward FLOPs per token per head of chunk_gated_delta_rule as implemented (2 per multiply-add):
    k k^T and q k^T (C K each), the unit-triangular inverse (C^2 / 6), [u | w] = inv [beta v | beta k e^G]
    (C (K + V)), w S and kd^T vnew in the state recursion (2 K V), q S (K V) and the intra-chunk
    product (C V)."""
    K, V, C = head_k_dim, head_v_dim, chunk_size
    return 2.0 * (2 * C * K + C * C / 6 + C * (K + V) + 3 * K * V + C * V)
