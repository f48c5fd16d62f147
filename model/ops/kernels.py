"""What every op shares with the GPU kernels it stands in for: the optional kernel lookup, the dtype
the kernels accumulate in, and the head layout they take (grouped heads repeated to the full count)."""
import functools
import importlib

import torch


@functools.cache
def _imported(module: str):
    """The module, or None if it does not import: tried once per process, not in every forward (a
    failed import is not cached by Python and searches sys.path again)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def optional_kernel(module: str, name: str, x: torch.Tensor):
    """`module.name` (e.g. "fla.ops.linear_attn", "chunk_linear_attn") when x is a CUDA tensor and the
    module imports (fla needs Triton); else None, and the caller runs its PyTorch form. The attribute
    is read on every call, so a wrapper set on the module (scripts/gpu_check.py counts kernel calls so) runs."""
    if not x.is_cuda or (found := _imported(module)) is None:
        return None
    return getattr(found, name)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half inputs (as the kernels accumulate); fp32 and fp64 stay as they are."""
    return torch.promote_types(dtype, torch.float32)


def repeat_heads(x: torch.Tensor, heads: int, dim: int = 2) -> torch.Tensor:
    """x with its G grouped heads (along dim) repeated to `heads`: head h reads group h // (heads / G)
    (GQA's key/value heads for the query heads, GDN's q, k for its value heads, SSD's B, C groups)."""
    groups = x.shape[dim]
    return x if groups == heads else x.repeat_interleave(heads // groups, dim=dim)
