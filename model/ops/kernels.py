"""What every op shares with the GPU kernels it stands in for: the optional kernel lookup, the dtype
the kernels accumulate in, autocast off inside an op (as inside a kernel), and the head layout they
take (grouped heads repeated to the full count)."""
import functools
import importlib
import warnings

import torch

# The devices whose tensors go to the kernel library (fla's Triton kernels). tests/test_fla_interpret.py
# adds "cpu" to run those kernels under Triton's interpreter through the same dispatch.
KERNEL_DEVICES = ("cuda",)
_unavailable: set[str] = set()  # the kernel packages whose failed import has been reported


@functools.cache
def _imported(module: str):
    """The module, or None if it does not import: tried once per process, not in every forward (a
    failed import is not cached by Python and searches sys.path again). A failure is reported once per
    package, with its error: a GPU run would otherwise take the PyTorch path without a word."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # a broken install raises more than ImportError (Triton's driver, version checks)
        package = module.split(".")[0]
        if package not in _unavailable:
            _unavailable.add(package)
            warnings.warn(f"{package} does not import ({type(e).__name__}: {e}): ops that would run its kernels "
                          "run their PyTorch path instead (several times slower on a GPU); "
                          "pip install -r requirements-gpu.txt", RuntimeWarning, stacklevel=3)
        return None


def kernel_runs(module: str, device) -> bool:
    """Whether ops on `device` (a torch.device or its type, "cpu", "cuda") run `module`'s kernels: the device is
    a KERNEL_DEVICES one (CUDA) and the module imports (fla needs Triton). optional_kernel dispatches on it and
    the ops' FLOP counts follow it, so a count is of the path that runs."""
    return torch.device(device).type in KERNEL_DEVICES and _imported(module) is not None


def optional_kernel(module: str, name: str, x: torch.Tensor):
    """`module.name` (e.g. "fla.ops.linear_attn", "chunk_linear_attn") when kernel_runs(module, x.device); else
    None, and the caller runs its PyTorch form. The attribute is read on every call, so a wrapper set on the
    module (scripts/gpu_check.py counts kernel calls so) runs."""
    return getattr(_imported(module), name) if kernel_runs(module, x.device) else None


def own_precision(fn):
    """Run an op with autocast off, as a kernel would: it takes its inputs' dtypes and accumulates in
    accumulation_dtype whatever autocast is on outside (inside, autocast would run the PyTorch forms'
    matmuls in bf16 and hand bf16 to ops that have no bf16 kernel, e.g. triangular solves)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)
    return wrapped


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half inputs (as the kernels accumulate); fp32 and fp64 stay as they are."""
    return torch.promote_types(dtype, torch.float32)


def repeat_heads(x: torch.Tensor, heads: int, dim: int = 2) -> torch.Tensor:
    """x with its G grouped heads (along dim) repeated to `heads`: head h reads group h // (heads / G)
    (GQA's key/value heads for the query heads, GDN's q, k for its value heads, SSD's B, C groups)."""
    groups = x.shape[dim]
    return x if groups == heads else x.repeat_interleave(heads // groups, dim=dim)
