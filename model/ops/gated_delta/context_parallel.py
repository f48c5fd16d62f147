"""The delta rule family's context-parallel form (the rule: model/ops/gated_delta; the exchanges: model/ops/context_parallel.py).

Per head the rule is affine in its state: over a run of tokens, h_out = A h_in + B with
A = prod_t (I - beta_t k_t k_t^T) Diag(alpha_t) [K, K] (the transition) and B [K, V] the state reached from zero;
the state's columns evolve apart, so the rule run from [h0 | I] on values [v | 0] carries both at once, and its
outputs' last K columns are scale A_{<=t}^T q_t. On its slice of a row each rank
  1. runs the head (the leading tokens that continue a document from the previous rank; the whole slice where
     no document starts in it) from [0 | I] on [v | 0]: the head's outputs from zero o^0, the projections
     p_t = scale A_{<=t}^T q_t, and its state map (A, B);
  2. runs the rest of the slice (the documents that start in it) from zero, each document on its own, as
     without context parallelism; where one starts the row's outgoing state is its last document's (B) and owes
     nothing to the incoming one (A = 0);
  3. all-gathers (A, B), float32, and composes the earlier ranks' maps in order: h_in (ContextGroup.incoming);
  4. adds the incoming state's share to the head's outputs: o_t = o^0_t + h_in^T p_t.
Every token runs through the rule once, the head's at V + K value columns instead of V; only the maps travel
(H (K K + K V) numbers per row), never activations. The calls are our chunked op's (fla's kernels on CUDA): a
batch of heads with an initial state, and the rest as packed sequences (cu_seqlens). Without decay (DeltaNet)
alpha = 1; with a decay per key channel (KDA) Diag(alpha_t) is one; beta in (0, 2) (negative eigenvalues) and GDN-2's
erase and write gates change nothing here. The same form serves derived GDN's gated delta rule (derived_gated_delta_rule_cp).
"""
import torch
import torch.nn.functional as F

from model.ops.gated_delta.chunk import CHUNK_SIZE, chunk_gated_delta_rule
from model.ops.gated_delta.derived import derived_inputs
from model.ops.kernels import accumulation_dtype, own_precision
from model.ops.varlen import sequence_cumsum


def head_tokens(segments, *xs):
    """Each x [B, L, ...] cut to the first n = max(1, longest head) tokens, zeroed past each row's head (a zero key,
    beta and log decay leave the state unchanged, a zero query reads nothing); and the mask [B, n]."""
    n = max(1, int(segments.head.max()))
    mask = torch.arange(n, device=segments.head.device) < segments.head[:, None]
    return [None if x is None else x[:, :n] * mask.view(*mask.shape, *[1] * (x.dim() - 2)).to(x.dtype) for x in xs], mask


def rest_layout(segments):
    """The tokens past each row's head as packed sequences: (their indices in the flattened slice [B L], their
    cu_seqlens, for each row the index among them of its last sequence)."""
    B, L = segments.starts.shape
    lengths = segments.cu_seqlens.diff()
    first = F.pad(segments.last_segment[:-1] + 1, (1, 0))  # each row's first segment
    kept = torch.ones_like(lengths, dtype=torch.bool).index_fill(0, first[segments.head > 0], False)
    index = (torch.arange(L, device=lengths.device) >= segments.head[:, None]).flatten().nonzero()[:, 0]
    return index, F.pad(lengths[kept].cumsum(0), (1, 0)), kept.long().cumsum(0)[segments.last_segment] - 1


@own_precision
def gated_delta_rule_cp(q, k, v, g, beta, segments, scale=None, chunk_size=CHUNK_SIZE, write=None):
    """chunk_gated_delta_rule's o [B, L, H, V] over this rank's slice of every row (segments: its DocumentSegments
    with a context), equal to the whole rows' rule in one process: q, k [B, L, H, K], v [B, L, H, V], g (None,
    [B, L, H] or [B, L, H, K]), beta [B, L, H] (or GDN-2's erase gate [B, L, H, K] with its write gate write
    [B, L, H, V]: the [0 | I] columns' write gate is 1, their values being 0)."""
    B, L, H, K = k.shape
    V = v.shape[-1]
    cd = accumulation_dtype(v.dtype)
    # 1. the heads, from [0 | I] on [v | 0]
    (hq, hk, hv, hg, hb, hw), mask = head_tokens(segments, q, k, v, g, beta, write)
    n = mask.shape[1]
    start = torch.cat([torch.zeros(B, H, K, V, dtype=cd, device=k.device),
                       torch.eye(K, dtype=cd, device=k.device).expand(B, H, K, K)], -1)
    hw = None if hw is None else torch.cat([hw, hw.new_ones(B, n, H, K)], -1)
    ho, hfinal = chunk_gated_delta_rule(hq, hk, torch.cat([hv, hv.new_zeros(B, n, H, K)], -1), hg, hb, scale=scale,
                                        initial_state=start, output_final_state=True, chunk_size=chunk_size, write=hw)
    transition, offset = hfinal[..., V:], hfinal[..., :V]
    # 2. the rest, each document from zero; a row's outgoing state where a document starts in it
    o = torch.cat([ho[..., :V], v.new_zeros(B, L - n, H, V)], 1).flatten(0, 1)  # the heads' o^0, in place
    index, cu_seqlens, last = rest_layout(segments)
    if len(index):
        *rest, rest_write = [None if x is None else x.flatten(0, 1)[index][None] for x in (q, k, v, g, beta, write)]
        ro, finals = chunk_gated_delta_rule(*rest, scale=scale, output_final_state=True, chunk_size=chunk_size,
                                            cu_seqlens=cu_seqlens, write=rest_write)
        o = o.index_copy(0, index, ro[0].to(o.dtype))
        cut = segments.cut.view(B, 1, 1, 1)
        offset = torch.where(cut, finals[last.clamp(min=0)].to(cd), offset)
        transition = transition * ~cut
    # 3. the state entering the slice; 4. its share of the heads' outputs
    incoming = segments.context.incoming(transition, offset, lambda a, s: a @ s)
    missing = torch.einsum("bthk,bhkv->bthv", ho[..., V:].to(cd), incoming) * mask[..., None, None]
    o = o.view(B, L, H, V)
    return torch.cat([o[:, :n] + missing.to(o.dtype), o[:, n:]], dim=1)


@own_precision
def derived_gated_delta_rule_cp(q, k, v, segments, scale=None, clamp_ktil=False):
    """derived_gated_delta_rule's o [B, L, H, V] over this rank's slice of every row, equal to one process's: t is
    each token's place in its document (segments.position_ids + 1), the running key and value sums continue
    from the earlier ranks' (an additive chain, cut at a document start), then the gated delta rule runs in
    its context-parallel form."""
    B, L, H, K = k.shape
    dtype, cd = v.dtype, accumulation_dtype(v.dtype)
    root = (K ** -0.5 if scale is None else scale) ** 0.5
    q, k, v = q.to(cd) * root, k.to(cd) * root, v.to(cd)
    t = (segments.position_ids + 1).to(cd)[..., None]  # [B, L, 1]
    sums = torch.cat([sequence_cumsum(segments.flatten(x), segments.cu_seqlens).view(B, L, H, -1) for x in (k, v)], -1)
    uncut = (~segments.cut).to(cd)[:, None, None]
    before = segments.context.incoming(uncut, sums[:, -1], lambda a, s: a * s)  # [B, H, K + V]
    head = (torch.arange(L, device=k.device) < segments.head[:, None]).to(cd)[..., None, None]
    sums = sums + head * before[:, None]
    ktil, vbar, written, g, beta = derived_inputs(k, v, sums[..., :K], sums[..., K:], t, clamp_ktil)
    o = gated_delta_rule_cp(q.to(dtype), ktil.to(dtype), written.to(dtype), g, beta, segments, scale=1.0)
    return (o.to(cd) + vbar).to(dtype)
