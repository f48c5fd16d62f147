"""The SSD's context-parallel form (the recurrence: model/ops/ssd; the exchanges: model/ops/context_parallel.py).

Per head the state [P, N] decays by a scalar: over a rank's slice of a row h_out = a h_in + B, with
a = prod_t a_t (signed with allow_neg_eigval) and B the state the scan reaches from zero. Each rank runs the scan
on its slice from zero (every document segment as without context parallelism), takes B from each row's last
segment and a from the decays of the row's head (its leading tokens that continue a segment from the previous
rank; a = 0 where a segment starts in the slice), all-gathers (a, B) in float32 and composes the earlier
ranks' maps (ContextGroup.incoming), then adds the incoming state's share to the head's outputs:
y_t += (prod_{s <= t} a_s) h_in C_t. Only (a, B) travels: H (1 + P N) numbers per row.
"""
import torch

from model.ops.gated_delta.context_parallel import head_tokens
from model.ops.kernels import own_precision, repeat_heads
from model.ops.ssd.chunk import discretise, log_transition, mamba_chunk_scan


@own_precision
def mamba_chunk_scan_cp(x, dt, A, B, C, chunk_size: int, segments, D=None, dt_bias=None, dt_softplus: bool = False,
                        allow_neg_eigval: bool = False):
    """mamba_chunk_scan's y [B, L, H, P] (z = None) over this rank's slice of every row (segments: its
    DocumentSegments with a context), equal to the whole rows' scan in one process."""
    Bsz, L, H, P = x.shape
    flat = segments.flatten
    y, finals = mamba_chunk_scan(flat(x), flat(dt), A, flat(B), flat(C), chunk_size, D=D, dt_bias=dt_bias,
                                 dt_softplus=dt_softplus, return_final_states=True, cu_seqlens=segments.cu_seqlens,
                                 allow_neg_eigval=allow_neg_eigval)
    offset = finals[segments.last_segment]  # [B, H, P, N], from zero
    (hx, hdt, hC), mask = head_tokens(segments, x, dt, C)
    _, hdt, Ac = discretise(hx, hdt, A, dt_bias, dt_softplus)
    log_decay, negative = log_transition(hdt, Ac, allow_neg_eigval)  # [B, n, H]
    log_decay = log_decay * mask[..., None]  # past the head: no decay (those tokens are not the head's)
    decay = log_decay.cumsum(1).exp()  # prod_{s <= t} |a_s| over the head
    if negative is not None:
        decay = decay * (1 - 2 * ((negative & mask[..., None]).long().cumsum(1) % 2)).to(decay.dtype)
    transition = decay[:, -1] * (~segments.cut).to(decay.dtype)[:, None]  # [B, H]
    incoming = segments.context.incoming(transition, offset, lambda a, s: a[..., None, None] * s)
    incoming = incoming * (segments.head > 0).to(incoming.dtype)[:, None, None, None]
    # the incoming state's share of each head token's output: (prod_{s <= t} a_s) h_in C_t
    missing = torch.einsum("bhpn,bthn->bthp", incoming, repeat_heads(hC.to(incoming.dtype), H)) * decay[..., None]
    missing = missing * mask[..., None, None]
    y = y.view(Bsz, L, H, P)
    n = mask.shape[1]
    return torch.cat([(y[:, :n].to(missing.dtype) + missing).to(y.dtype), y[:, n:]], dim=1)
