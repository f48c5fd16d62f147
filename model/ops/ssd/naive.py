"""The SSD recurrence token by token, straight from the formulas: the tests' oracle, run in float64."""
import torch
import torch.nn.functional as F


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
