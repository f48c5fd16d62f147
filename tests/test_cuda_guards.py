"""What the CUDA paths assume of their inputs, checked on the CPU: MoE's grouped-GEMM guard against
torch._grouped_mm's own checks (its meta function, which torch.compile runs)."""
import pytest
import torch

from model.ffn.moe import experts_grouped_mm, grouped_mm_takes

pytestmark = pytest.mark.usefixtures("one_thread")


def grouped_mm_runs(dtype: torch.dtype, d: int, f: int) -> str | None:
    """None if experts_grouped_mm runs forward and backward on meta tensors of this dtype and widths,
    else torch's error."""
    xs = torch.empty(10, d, dtype=dtype, device="meta", requires_grad=True)
    w_gu = torch.empty(3, d, 2 * f, dtype=dtype, device="meta", requires_grad=True)
    w_d = torch.empty(3, f, d, dtype=dtype, device="meta", requires_grad=True)
    try:
        ys = experts_grouped_mm(xs, w_gu, w_d, torch.tensor([3, 0, 7], device="meta"))
        torch.autograd.grad(ys, (xs, w_gu, w_d), torch.empty_like(ys))
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("d, f", [(64, 64), (64, 40), (56, 24), (64, 100), (100, 64), (64, 36), (36, 64)])
def test_grouped_mm_guard_is_the_ops_own_check(dtype, d, f):
    """The guard says yes exactly when torch's checks pass: bf16 only (fp32 fails when compiled) and
    16-byte rows for d and for the expert width f (f = 100 with d = 64 fails in the second GEMM)."""
    error = grouped_mm_runs(dtype, d, f)
    assert grouped_mm_takes(dtype, d, f) == (error is None), error
