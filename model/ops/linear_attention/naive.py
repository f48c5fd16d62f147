"""Causal linear attention token by token, straight from the formulas: the tests' oracle, run in float64."""
import torch


def naive_linear_attn(q, k, v, scale, S0=None, z0=None, normalize=False, eps=1e-6):
    """S_t = S_{t-1} + k_t v_t^T; o_t = S_t^T (scale q_t); normalised: o_t / ((scale q_t) . z_t + eps),
    z_t = z_{t-1} + k_t."""
    Bsz, T, H, K = q.shape
    V = v.shape[-1]
    outs, S_fin, z_fin = [], [], []
    for b in range(Bsz):
        ob, Sb, zb = [], [], []
        for h in range(H):
            S = torch.zeros(K, V, dtype=q.dtype) if S0 is None else S0[b, h]
            z = torch.zeros(K, dtype=q.dtype) if z0 is None else z0[b, h]
            oh = []
            for t in range(T):
                S = S + torch.outer(k[b, t, h], v[b, t, h])
                z = z + k[b, t, h]
                o = S.T @ (scale * q[b, t, h])
                if normalize:
                    o = o / ((scale * q[b, t, h]) @ z + eps)
                oh.append(o)
            ob.append(torch.stack(oh))
            Sb.append(S)
            zb.append(z)
        outs.append(torch.stack(ob, 1))
        S_fin.append(torch.stack(Sb))
        z_fin.append(torch.stack(zb))
    return torch.stack(outs), torch.stack(S_fin), torch.stack(z_fin)
