"""Dense SwiGLU FFN: y = W_down (silu(W_gate x) * W_up x).

Init as Llama's MLP: N(0, initializer_range) for all three; ours differs on purpose in one place,
shared by every block: down_proj, which writes into the residual stream, gets std * 1/sqrt(2 L)
(model/layers.py residual_scale), or starts at 0 where the model's parametrization says so (model/config.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import initialization as init

from model.layers import ffn_residual_scale
from model.registry import FFNS


@FFNS.register("dense")
class SwiGLU(nn.Module):
    def __init__(self, config, layer_idx: int = 0, intermediate_size: int | None = None):
        super().__init__()
        d, f = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.init_std, self.residual_scale = config.initializer_range, ffn_residual_scale(config)

    def init_parameters(self) -> None:
        init.normal_(self.gate_proj.weight, mean=0.0, std=self.init_std)
        init.normal_(self.up_proj.weight, mean=0.0, std=self.init_std)
        init.normal_(self.down_proj.weight, mean=0.0, std=self.init_std * self.residual_scale)

    def forward(self, x: torch.Tensor, aux=None, token_ids=None, real=None) -> torch.Tensor:
        """Per token: a pad (real False) costs its compute and changes nothing else."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def flops_per_token(self) -> int:
        return 2 * 3 * self.gate_proj.in_features * self.gate_proj.out_features
