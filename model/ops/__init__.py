"""Pure-PyTorch sequence-mixing ops with the GPU kernels' signatures and [B, T, H, D] layouts, in
fla's layout: each op file holds its chunked form, its recurrent (decoding) form where it has one
(gated_delta, ssd) and its `naive_` references, the formulas written out token by token that the
tests check it against. On CUDA tensors, when the kernel library imports, `kernels.optional_kernel`
hands the call to the kernel instead; CPU tensors never reach Triton. `kernels.accumulation_dtype`
is the dtype every op computes in."""
