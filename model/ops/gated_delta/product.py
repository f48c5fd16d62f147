"""Gated DeltaProduct (Siems et al. 2025, "DeltaProduct: Improving State-Tracking in Linear RNNs via Householder
Products"): n delta-rule steps per token, each with its own key, value and beta, the decay once per token,

    h = Diag(exp g_t) h;  for j = 1..n: h = h + beta_tj k_tj (v_tj - h^T k_tj)^T;   o_t = h^T (scale q_t)

so the transition of a token is a product of n generalized Householder matrices (identity plus rank n). As fla
lays it out, keys, values and betas come as [B, T n, H, *] with the n steps of a token consecutive; the rule runs
on that interleaved sequence of T n steps with the decay at each token's first step, its query at its last, and
the outputs are read there (a zero query reads nothing, a zero log decay changes nothing). The chunked form hands
the rule the T queries alone (query_every = n: its output side runs at those rows only, its chunk a multiple of
n). Packed sequences, initial and final states and context parallelism are the rule's own (cu_seqlens n,
DocumentSegments.repeated).
"""
import torch

from model.ops.gated_delta.chunk import CHUNK_SIZE, chunk_gated_delta_rule, spread_queries
from model.ops.gated_delta.context_parallel import gated_delta_rule_cp
from model.ops.gated_delta.recurrent import fused_recurrent_gated_delta_rule


def householder_steps(q: torch.Tensor, g: torch.Tensor | None, steps: int) -> tuple:
    """q [B, T, H, K] and g ([B, T, H] or None) on the interleaved T steps sequence: each token's query at its
    last step, its log decay at its first, zeros elsewhere."""
    return spread_queries(q, steps), None if g is None else spread_decays(g, steps)


def spread_decays(g: torch.Tensor, steps: int) -> torch.Tensor:
    """g [B, T, H] on the interleaved T steps sequence: each token's log decay at its first step, zeros elsewhere."""
    gs = g.new_zeros(g.shape[0], g.shape[1], steps, *g.shape[2:])
    gs[:, :, 0] = g
    return gs.flatten(1, 2)


def _check_steps(q, k, steps: int) -> None:
    if k.shape[1] != q.shape[1] * steps:
        raise ValueError(f"k of {k.shape[1]} steps for {q.shape[1]} tokens; valid: {q.shape[1] * steps} "
                         f"(num_householder={steps} per token)")


def chunk_gated_delta_product(q, k, v, g, beta, num_householder: int, scale=None, initial_state=None,
                              output_final_state=False, chunk_size=CHUNK_SIZE, cu_seqlens=None):
    """q [B, T, H, K]; k [B, T n, H, K], v [B, T n, H, V], beta [B, T n, H] (n = num_householder steps per token);
    g None or [B, T, H] (per head); chunk_size counts steps (rounded down to a multiple of n). Returns
    (o [B, T, H, V], final state or None) as chunk_gated_delta_rule."""
    _check_steps(q, k, num_householder)
    n = num_householder
    return chunk_gated_delta_rule(q, k, v, None if g is None else spread_decays(g, n), beta, scale=scale,
                                  initial_state=initial_state, output_final_state=output_final_state,
                                  chunk_size=chunk_size, cu_seqlens=None if cu_seqlens is None else cu_seqlens * n,
                                  query_every=n)


def fused_recurrent_gated_delta_product(q, k, v, g, beta, num_householder: int, scale=None, initial_state=None,
                                        output_final_state=False, cu_seqlens=None):
    """The per-token form (decoding): same arguments and returns as chunk_gated_delta_product."""
    _check_steps(q, k, num_householder)
    qs, gs = householder_steps(q, g, num_householder)
    o, state = fused_recurrent_gated_delta_rule(qs, k, v, gs, beta, scale=scale, initial_state=initial_state,
                                                output_final_state=output_final_state,
                                                cu_seqlens=None if cu_seqlens is None else cu_seqlens * num_householder)
    return o[:, num_householder - 1::num_householder], state


def gated_delta_product_cp(q, k, v, g, beta, num_householder: int, segments, scale=None, chunk_size=CHUNK_SIZE):
    """o [B, L, H, V] over this rank's slice (context parallelism): the rule's own form on the interleaved slice,
    its segments each token's repeated (DocumentSegments.repeated)."""
    _check_steps(q, k, num_householder)
    qs, gs = householder_steps(q, g, num_householder)
    o = gated_delta_rule_cp(qs, k, v, gs, beta, segments.repeated(num_householder), scale=scale, chunk_size=chunk_size)
    return o[:, num_householder - 1::num_householder]
