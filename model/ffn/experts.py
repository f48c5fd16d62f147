"""The routed experts' SwiGLUs over rows grouped by expert: torch._grouped_mm where it takes the operands (bf16 on
CUDA), else ExpertsLoop, one autograd node for every expert (model/ffn/moe.py dispatches)."""
import torch
import torch.nn.functional as F


def grouped_mm_takes(dtype: torch.dtype, d: int, f: int) -> bool:
    """Whether torch._grouped_mm takes the experts' operands (the checks of its meta function, which
    torch.compile runs; the eager kernel fails on misaligned rows too): bf16 only, and every operand's
    rows a multiple of 16 bytes, xs [S, d], W_gu [E, d, 2f], silu(gate) up [S, f], W_d [E, f, d]: both d and f."""
    return dtype == torch.bfloat16 and d % 8 == 0 and f % 8 == 0  # 8 bf16 = 16 bytes


def experts_grouped_mm(xs: torch.Tensor, w_gu: torch.Tensor, w_d: torch.Tensor, counts: torch.Tensor):
    """All experts in two grouped matmuls; rows of xs [S, d] are grouped by expert, counts [E]."""
    offs = counts.cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(xs, w_gu, offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w_d, offs=offs)


class ExpertsLoop(torch.autograd.Function):
    """ys[rows of e] = (silu(xs W_g,e) * xs W_u,e) W_d,e for each expert e over its contiguous rows.

    One autograd node for all experts, every product written in place into preallocated buffers
    (per-expert autograd would build ~10 nodes per expert and a zero-filled [E, ...] gradient for
    each weight slice)."""

    @staticmethod
    def forward(ctx, xs, w_gu, w_d, counts: list[int]):
        S, f = xs.shape[0], w_d.shape[1]
        h = xs.new_empty(S, 2 * f)  # [x W_g | x W_u]
        act = xs.new_empty(S, f)
        ys = xs.new_empty(S, xs.shape[1])
        start = 0
        for e, n in enumerate(counts):
            rows = slice(start, start + n)
            start += n
            if n == 0:
                continue
            torch.mm(xs[rows], w_gu[e], out=h[rows])
            torch.mul(F.silu(h[rows, :f]), h[rows, f:], out=act[rows])
            torch.mm(act[rows], w_d[e], out=ys[rows])
        ctx.save_for_backward(xs, w_gu, w_d, h, act)
        ctx.counts = counts
        return ys

    @staticmethod
    def backward(ctx, grad_ys):
        xs, w_gu, w_d, h, act = ctx.saved_tensors
        f = w_d.shape[1]
        grad_ys = grad_ys.contiguous()
        grad_xs, grad_gu, grad_d = torch.empty_like(xs), torch.empty_like(w_gu), torch.empty_like(w_d)
        grad_act = torch.empty_like(act)
        grad_h = torch.empty_like(h)
        start = 0
        for e, n in enumerate(ctx.counts):
            rows = slice(start, start + n)
            start += n
            if n == 0:
                grad_gu[e].zero_()
                grad_d[e].zero_()
                continue
            gate, up = h[rows, :f], h[rows, f:]
            torch.mm(act[rows].t(), grad_ys[rows], out=grad_d[e])
            torch.mm(grad_ys[rows], w_d[e].t(), out=grad_act[rows])
            # d act / d up = silu(gate); d act / d gate = up * silu'(gate)
            torch.mul(grad_act[rows], F.silu(gate), out=grad_h[rows, f:])
            grad_h[rows, :f] = torch.ops.aten.silu_backward(grad_act[rows] * up, gate)
            torch.mm(grad_h[rows], w_gu[e].t(), out=grad_xs[rows])
            torch.mm(xs[rows].t(), grad_h[rows], out=grad_gu[e])
        return grad_xs, grad_gu, grad_d, None
