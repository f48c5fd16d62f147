"""Pure-PyTorch sequence-mixing ops with the GPU kernels' signatures and [B, T, H, D] layouts, in
fla's layout: a folder per op (gated_delta/, linear_attention/, ssd/, sparse_attention/, attention/)
holding its chunked form (chunk.py), its recurrent (decoding) form where it has one (recurrent.py),
its `naive_` references (naive.py), the formulas written out token by token that the tests check it
against, and its context-parallel form (context_parallel.py). On CUDA tensors, when the kernel
library imports, `kernels.optional_kernel` hands the call to the kernel instead; CPU tensors never
reach Triton. `kernels.accumulation_dtype` is the dtype every op computes in. Shared by the ops:
context_parallel.py (the exchanges between a context group's ranks), kernels.py, varlen.py."""
