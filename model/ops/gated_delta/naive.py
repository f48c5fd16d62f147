"""The recurrences token by token, straight from the formulas: the tests' oracles, run in float64."""
import torch


def naive_gated_delta(q, k, v, g, beta, scale=None, h=None):
    """h = Diag(exp(g_t)) h; u = beta_t (v_t - h^T k_t); h = h + k_t u^T; o_t = h^T (scale q_t).
    g: None (no decay), [B, T, H] (per head) or [B, T, H, K] (per key channel)."""
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

