"""Causal linear attention, in PyTorch.

    S_t = S_{t-1} + k_t v_t^T,   o_t = S_t^T (scale q_t)                       (state [K, V])
    normalize=True:  o_t <- o_t / ((scale q_t) . z_t + eps),  z_t = z_{t-1} + k_t

Layouts as in fla's chunk_linear_attn: q, k [B, T, H, K], v [B, T, H, V], state [B, H, K, V],
normaliser state z [B, H, K].
cu_seqlens (fla's convention, model/ops/varlen.py): a batch-1 row of several sequences, each
starting from a zero state; final states are then one per sequence.

The forms, as fla lays an op out: chunk.py (chunked, with the scalar-decay core the SSD shares), naive.py (the
float64 oracle), context_parallel.py (one sequence across ranks).
"""
from model.ops.linear_attention.chunk import (FLA_CHUNK_SIZE, chunk_flops_per_token, chunk_linear_attn,
                                              chunk_linear_attn_flops, chunk_scalar_decay)
from model.ops.linear_attention.naive import naive_linear_attn
