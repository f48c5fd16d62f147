"""The SSD one token at a time, for decoding (the recurrence and its layouts: model/ops/ssd)."""
import torch

from model.ops.kernels import own_precision, repeat_heads
from model.ops.ssd.chunk import discretise, log_transition, skip_and_gate


@own_precision
def mamba_state_step(x, dt, A, B, C, state, D=None, z=None, dt_bias=None, dt_softplus: bool = False,
                     allow_neg_eigval: bool = False):
    """One decoding step of the SSD recurrence: x [B, H, P], dt [B, H], B, C [B, G, N],
    state [B, H, P, N]. Returns (y [B, H, P] in x's dtype, new state in the compute dtype)."""
    xc, dt, A = discretise(x, dt, A, dt_bias, dt_softplus)
    ct = xc.dtype
    B, C = (repeat_heads(t.to(ct), x.shape[1], dim=1) for t in (B, C))  # [B, H, N]
    g, negative = log_transition(dt, A, allow_neg_eigval)
    a = g.exp() if negative is None else torch.where(negative, -g.exp(), g.exp())
    # h = a h + (dt x) B^T;  y = h C
    state = state.to(ct) * a[..., None, None] + (dt[..., None] * xc)[..., None] * B[:, :, None, :]
    y = (state @ C[..., None]).squeeze(-1)
    return skip_and_gate(y, xc, D, z).to(x.dtype), state
