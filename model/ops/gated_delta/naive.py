"""The recurrences token by token, straight from the formulas: the tests' oracles, run in float64."""
import torch


def naive_gated_delta(q, k, v, g, beta, scale=None, h=None, write=None):
    """h = Diag(exp(g_t)) h; u = beta_t (v_t - h^T k_t); h = h + k_t u^T; o_t = h^T (scale q_t).
    g: None (no decay), [B, T, H] (per head) or [B, T, H, K] (per key channel). With GDN-2's gates, beta [B, T, H, K]
    (erase b) and write [B, T, H, V] (w): u = w_t o v_t - h^T (b_t o k_t)."""
    if write is not None:
        return _naive_gdn2(q, k, v, g, beta, write, scale, h)
    B, T, H, K = k.shape
    scale = K ** -0.5 if scale is None else scale
    h = q.new_zeros(B, H, K, v.shape[-1]) if h is None else h
    out = []
    for t in range(T):
        if g is not None:
            h = h * g[:, t].reshape(B, H, -1, 1).exp()
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", h, k[:, t]))
        h = h + k[:, t, :, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", h, scale * q[:, t]))
    return torch.stack(out, 1), h


def naive_derived_gated_delta(q, k, v, scale=None, clamp=False, state=None):
    """derived_gated_delta_rule's recursion, S_t = A_t in [V, K]:  ktil_t = k_t - kbar_t, vtil_t = v_t - vbar_{t-1},
    A_t = A_{t-1} ((1 - 1/t) I - (1/t) ktil ktil^T) + (1/t) vtil ktil^T, o_t = A_t q_t + vbar_t;
    q, k times scale^1/2 (default d^-1/4 each). clamp: ktil scaled to |ktil|^2 <= 2t - 1.
    state / returned: (A, k_sum, v_sum, t)."""
    B, T, H, K = k.shape
    s = (K ** -0.5 if scale is None else scale) ** 0.5
    q, k = q * s, k * s
    if state is None:
        state = (q.new_zeros(B, H, v.shape[-1], K), q.new_zeros(B, H, K), q.new_zeros(B, H, v.shape[-1]), 0)
    A, k_sum, v_sum, t0 = state
    eye = torch.eye(K, dtype=q.dtype)
    out = []
    for i in range(T):
        t = t0 + i + 1
        k_sum = k_sum + k[:, i]
        ktil = k[:, i] - k_sum / t
        if clamp:
            ktil = ktil / torch.maximum(torch.ones(()), ktil.pow(2).sum(-1, keepdim=True) / (2 * t - 1)).sqrt()
        vtil = v[:, i] - (v_sum / (t - 1) if t > 1 else 0)
        v_sum = v_sum + v[:, i]
        A = A @ ((1 - 1 / t) * eye - ktil[..., :, None] * ktil[..., None, :] / t) \
            + vtil[..., :, None] * ktil[..., None, :] / t
        out.append((A @ q[:, i, ..., None])[..., 0] + v_sum / t)
    return torch.stack(out, 1), (A, k_sum, v_sum, t0 + T)


def _naive_gdn2(q, k, v, g, b, w, scale, h):
    """GDN-2 as its paper writes it, S_t = (I - k_t (b_t o k_t)^T) Diag(exp g_t) S_{t-1} + k_t (w_t o v_t)^T (S [K, V]),
    o_t = S_t^T (scale q_t); b [B, T, H] is a scalar erase gate."""
    B, T, H, K = k.shape
    scale = K ** -0.5 if scale is None else scale
    b = b[..., None].expand(k.shape) if b.dim() == 3 else b
    S = q.new_zeros(B, H, K, v.shape[-1]) if h is None else h
    eye = torch.eye(K, dtype=q.dtype)
    out = []
    for t in range(T):
        decay = torch.ones_like(k[:, t]) if g is None else g[:, t].reshape(B, H, -1).exp().expand(B, H, K)
        erase = eye - k[:, t, :, :, None] * (b[:, t] * k[:, t])[:, :, None, :]
        S = erase @ (decay[..., None] * S) + k[:, t, :, :, None] * (w[:, t] * v[:, t])[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, scale * q[:, t]))
    return torch.stack(out, 1), S


def naive_gated_delta_product(q, k, v, g, beta, num_householder, scale=None, h=None):
    """DeltaProduct per token: h = Diag(exp g_t) h, then for each of its n steps j h = h + beta_tj k_tj (v_tj -
    h^T k_tj)^T; o_t = h^T (scale q_t). k, v, beta [B, T n, ...] (a token's n steps consecutive), g None or [B, T, H]."""
    B, T, H, K = q.shape
    n = num_householder
    scale = K ** -0.5 if scale is None else scale
    h = q.new_zeros(B, H, K, v.shape[-1]) if h is None else h
    out = []
    for t in range(T):
        if g is not None:
            h = h * g[:, t, :, None, None].exp()
        for j in range(t * n, t * n + n):
            u = beta[:, j, :, None] * (v[:, j] - torch.einsum("bhkv,bhk->bhv", h, k[:, j]))
            h = h + k[:, j, :, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", h, scale * q[:, t]))
    return torch.stack(out, 1), h
