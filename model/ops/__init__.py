"""Pure-PyTorch sequence-mixing ops with the GPU kernels' signatures and [B, T, H, D] layouts, in
fla's layout: each op file holds its chunked form, its recurrent (decoding) form and its `naive_`
reference, the token-by-token formula the tests check it against. On CUDA tensors, when the kernel
library imports, `kernels.optional_kernel` hands the call to the kernel instead; CPU tensors never
reach Triton. `kernels.accumulation_dtype` is the dtype every op computes in."""
