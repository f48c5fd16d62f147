"""The delta rule family (DeltaNet, Gated DeltaNet, KDA) and the derived-GDN recursion, in PyTorch.

Recurrence per head, state h [K, V]:
    h_t = Diag(alpha_t) h_{t-1};  u_t = beta_t (v_t - h_t^T k_t);  h_t = h_t + k_t u_t^T;  o_t = h_t^T (scale q_t)
i.e. S_t = S_{t-1} Diag(alpha_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T with S = h^T, alpha_t = exp(g_t), where
the log decay g is one of (one op, dispatched on g's shape):
    None          no decay, alpha = 1: DeltaNet (Yang et al. 2024);
    [B, T, H]     one decay per head: Gated DeltaNet (Yang et al. 2025);
    [B, T, H, K]  one decay per key channel: KDA (Kimi Linear, Kimi Team 2025).
Any beta is exact, beta in (0, 2) included (the transition's eigenvalue 1 - beta_t along k_t then reaches
into (-1, 0): Grazzi et al. 2025's negative eigenvalues).

Layouts follow fla: q, k [B, T, H, K], v [B, T, H, V], beta [B, T, H], state [B, H, K, V].
All arithmetic is in fp32 (fp64 for fp64 inputs); outputs are cast back to the input dtype, states
stay in the compute dtype. On CUDA tensors the fla kernels are used when fla imports (CHUNK_KERNELS,
RECURRENT_KERNELS).
cu_seqlens (fla's convention, model/ops/varlen.py): q.. of batch 1 hold several sequences, the state
restarting from zero at each; final states are then [N, H, K, V], one per sequence.

The forms, as fla lays an op out: chunk.py (chunked, training and prefill), recurrent.py (per token, decoding),
naive.py (the float64 oracles), context_parallel.py (one sequence across ranks), derived.py (derived GDN's
gated delta rule with fixed gates).
"""
from model.ops.gated_delta.chunk import (CHUNK_SIZE, FLA_CHUNK_SIZE, chunk_gated_delta_flops, chunk_gated_delta_rule,
                                         chunk_size_on, decay_form)
from model.ops.gated_delta.derived import derived_gated_delta_rule, derived_inputs
from model.ops.gated_delta.naive import naive_derived_gated_delta, naive_gated_delta
from model.ops.gated_delta.recurrent import fused_recurrent_gated_delta_rule
