"""Gated DeltaNet-2 (GDN-2; "Gated DeltaNet-2: Decoupling Erase and Write in Linear Attention", arXiv 2605.22791,
NVlabs/GatedDeltaNet-2 as fla's GatedDeltaNet2 layer adapts it): KDA's scalar beta split into two gates per channel,
an erase gate b over the key channels and a write gate w over the value channels,

    q, k = l2norm(silu(conv(W_q x))), l2norm(silu(conv(W_k x))),  v = silu(conv(W_v x))
    b = sigmoid(W_b x) [B, T, H, d_k],  w = sigmoid(W_w x) [B, T, Hv, d_v]
    g_t = -exp(A_log) softplus(W_f2 W_f1 x_t + dt_bias)     [B, T, H, d_k], low-rank W_f2 W_f1 (rank d_v), per q/k head
    S_t = (I - k_t (b_t o k_t)^T) Diag(exp g_t) S_{t-1} + k_t (w_t o v_t)^T,  o_t = S_t^T q_t / sqrt(d_k)
    y = W_o [RMSNorm(o) * sigmoid(W_g2 W_g1 x + b_g)]   (per head, norm before the gate; low-rank gate, rank d_v)

With b = w = beta it is KDA; with a scalar decay too, GDN. allow_neg_eigval: b = 2 sigmoid(W_b x) in (0, 2), the
erase gate only, as fla's (Grazzi et al. 2025; model/mixers/delta_rule.py). The decay, b, q and k are per q/k head,
repeated to the value heads (num_v_heads). The block (short convs, q/k norm, decoding through the conv tails and the
state h [B, Hv, d_k, d_v]) is DeltaRuleBlock's; the rule runs on model/ops/gated_delta with its per-channel gates
(fla's chunk_gdn2 / fused_recurrent_gdn2 on CUDA).

Init as fla's layer and KDA's model (fla has no GDN-2 model): every projection N(0, initializer_range), the output
gate's bias 0, A ~ U(1, 16) stored as log A per q/k head, softplus(dt_bias) ~ logU(1e-3, 1e-1) floored at 1e-4 per
(q/k head, key channel), the norm's weight 1; with DeltaRuleBlock's short-conv kernels and its one deliberate
difference, o_proj's residual scale (model/mixers/delta_rule.py).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import initialization as init

from model.layers import GatedRMSNorm, at_least_fp32, init_A_log_, init_dt_bias_
from model.mixers.delta_rule import DeltaRuleBlock
from model.mixers.gdn import GDNOptions
from model.ops.kernels import repeat_heads
from model.options import option
from model.registry import MIXERS


@dataclass
class GDN2Options(GDNOptions):
    expand_v: float = option(1, above=0)  # fla's GatedDeltaNet2 default


@MIXERS.register("gdn2")
class GatedDeltaNet2(DeltaRuleBlock):
    Options = GDN2Options
    per_channel_decay = True
    erase_per_channel = True

    def __init__(self, config, layer_idx: int = 0):
        opts = config.options_for_mixer("gdn2", GDN2Options)
        super().__init__(config, layer_idx, "gdn2", opts, opts.num_v_heads)
        d, rank = config.hidden_size, self.head_v_dim
        self.w_proj = nn.Linear(d, self.value_dim, bias=False)
        self.f_proj = nn.Sequential(nn.Linear(d, rank, bias=False), nn.Linear(rank, self.key_dim, bias=False))
        self.g_proj = nn.Sequential(nn.Linear(d, rank, bias=False), nn.Linear(rank, self.value_dim, bias=True))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.key_dim))
        self.o_norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, norm_before_gate=True, activation="sigmoid")

    def init_parameters(self) -> None:
        self.init_projections(self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.w_proj, *self.f_proj,
                              *self.g_proj)
        self.init_convs_and_output()
        init.zeros_(self.g_proj[1].bias)
        init_A_log_(self.A_log, 1.0, 16.0)
        init_dt_bias_(self.dt_bias)

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        erase = at_least_fp32(self.b_proj(x)).sigmoid().view(B, T, self.num_heads, self.head_dim)
        write = at_least_fp32(self.w_proj(x)).sigmoid().view(B, T, self.num_v_heads, self.head_v_dim)
        return repeat_heads(erase * (2 if self.allow_neg_eigval else 1), self.num_v_heads), write

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        f = at_least_fp32(self.f_proj(x)).view(B, T, self.num_heads, self.head_dim) + self.dt_bias.view(
            self.num_heads, self.head_dim)
        return repeat_heads(-at_least_fp32(self.A_log).exp()[:, None] * F.softplus(f), self.num_v_heads)

    def normalize(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_norm(o, self.g_proj(x).view(o.shape))

    def flops_per_token(self, seq_len: int, device) -> float:
        d, rank = self.q_proj.in_features, self.head_v_dim
        low_rank = 2 * (2 * d * rank + rank * (self.key_dim + self.value_dim))  # f, g
        return super().flops_per_token(seq_len, device) + low_rank + 2 * d * self.value_dim  # + w
