"""DeepSeek Sparse Attention's ops (DSA, DeepSeek-V3.2), in PyTorch: attention restricted to the keys each query
selected, and the lightning indexer that selects them. Layouts as in the kernels: q [B, T, H, D], k, v [B, S, Hkv, D]
(GQA: H a multiple of Hkv), indexer q_i [B, T, H_I, d_I], shared indexer key k_i [B, S, d_I], head weights
w [B, T, H_I]; `indices` [B, T, K] int64 holds, per query, the key positions it may attend to, -1 for an empty slot
(FlashMLA's sparse convention). The T queries sit at positions S - T .. S - 1 of the S keys.
Everything accumulates in fp32 (fp64 for fp64 inputs). No installable GPU kernel fits these shapes
(docs/studies/dsa.md), so CUDA tensors run these same paths (cuSPARSE / fused SDPA).

The files: attention.py (the sparse and masked paths over the selected keys, and the choice between them),
selection.py (the selection as sparse matrices), cpu_kernels.py (its numba kernels and the indexer's top-k, on
CPU), lightning_indexer.py (the indexer's scores and top-k selection), naive.py (the float64 oracles),
context_parallel.py (one sequence across ranks: only the selected keys and values travel).
"""
from model.ops.sparse_attention.attention import (attention_path, dense_attention_probs, masked_attention,
                                                  selected_attention, selected_attention_probs, sparse_attention,
                                                  sparse_attention_with_probs)
from model.ops.sparse_attention.lightning_indexer import index_scores, index_scores_at, index_topk
from model.ops.sparse_attention.naive import naive_index_scores, naive_masked_attention, naive_sparse_attention
from model.ops.sparse_attention.selection import Selection
