"""Pure-PyTorch sequence-mixing ops with the GPU kernels' signatures and [B, T, H, D] layouts.
On CUDA tensors, when the kernel library imports, the dispatcher calls the kernel instead; CPU
tensors never reach Triton."""
