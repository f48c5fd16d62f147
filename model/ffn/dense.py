"""Dense SwiGLU FFN: y = W_down (silu(W_gate x) * W_up x)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from model.registry import FFNS


@FFNS.register("dense")
class SwiGLU(nn.Module):
    def __init__(self, config, layer_idx: int = 0, intermediate_size: int | None = None):
        super().__init__()
        d, f = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.down_proj.is_residual_out = True

    def forward(self, x: torch.Tensor, aux=None) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def flops_per_token(self) -> int:
        return 2 * 3 * self.gate_proj.in_features * self.gate_proj.out_features
