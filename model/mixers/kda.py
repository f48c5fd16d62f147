"""Kimi Delta Attention (Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention Architecture"; the
flash-linear-attention KimiDeltaAttention layer): Gated DeltaNet with a decay per key channel,

    q, k = l2norm(silu(conv(W_q x))), l2norm(silu(conv(W_k x))),  v = silu(conv(W_v x)),  beta = sigmoid(W_b x)
    g_t = -exp(A_log) softplus(W_f2 W_f1 x_t + dt_bias)          [B, T, Hv, d_k], low-rank W_f2 W_f1 (rank d_v)
    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t / sqrt(d_k)
    y = W_o [RMSNorm(o) * sigmoid(W_g2 W_g1 x + b_g)]   (per head, norm before the gate; low-rank gate, rank d_v)

lower_bound (fla's lower-bounded gate, off by default): g_t = lower_bound * sigmoid(exp(A_log) (W_f2 W_f1 x_t +
dt_bias)) in (lower_bound, 0), with A_log = 0 at init as fla's safe_gate layer (fla recommends -5).
allow_neg_eigval: beta in (0, 2) (Grazzi et al. 2025; model/mixers/delta_rule.py). The block (short convs, q/k norm,
beta, decoding through the conv tails and the state h [B, Hv, d_k, d_v]) is DeltaRuleBlock's; the rule runs on
model/ops/gated_delta with g [B, T, Hv, d_k] (fla's chunk_kda / fused_recurrent_kda on CUDA, the decay
computed here and handed to the kernel precomputed).

Init as fla's KDAPreTrainedModel: every projection N(0, initializer_range), the gate's bias 0, A ~ U(1, 16)
stored as log A (0 with lower_bound), softplus(dt_bias) ~ logU(1e-3, 1e-1) floored at 1e-4 per (head, key
channel), the norm's weight 1; with DeltaRuleBlock's short-conv kernels N(0, initializer_range) as fla's and
its one deliberate difference, o_proj's residual scale (model/mixers/delta_rule.py).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import initialization as init

from model.layers import GatedRMSNorm, at_least_fp32, init_A_log_, init_dt_bias_
from model.mixers.delta_rule import DeltaRuleBlock
from model.mixers.gdn import GDNOptions
from model.options import bad_option, option
from model.registry import MIXERS


@dataclass
class KDAOptions(GDNOptions):
    expand_v: float = option(1, above=0)
    lower_bound: float | None = option(None)  # None: -exp(A_log) softplus(.); a negative number: the bounded gate


@MIXERS.register("kda")
class KimiDeltaAttention(DeltaRuleBlock):
    Options = KDAOptions
    per_channel_decay = True

    def __init__(self, config, layer_idx: int = 0):
        opts = config.options_for_mixer("kda", KDAOptions)
        super().__init__(config, layer_idx, "kda", opts, opts.num_v_heads)
        if opts.lower_bound is not None and opts.lower_bound >= 0:
            raise bad_option("kda", "lower_bound", opts.lower_bound, "a negative number or null")
        self.lower_bound = opts.lower_bound
        d, rank = config.hidden_size, self.head_v_dim
        self.f_proj = nn.Sequential(nn.Linear(d, rank, bias=False), nn.Linear(rank, self.num_v_heads * self.head_dim,
                                                                              bias=False))
        self.g_proj = nn.Sequential(nn.Linear(d, rank, bias=False), nn.Linear(rank, self.value_dim, bias=True))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads * self.head_dim))
        self.o_norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, norm_before_gate=True, activation="sigmoid")

    def init_parameters(self) -> None:
        self.init_projections(self.q_proj, self.k_proj, self.v_proj, self.b_proj, *self.f_proj, *self.g_proj)
        self.init_convs_and_output()
        init.zeros_(self.g_proj[1].bias)
        if self.lower_bound is None:
            init_A_log_(self.A_log, 1.0, 16.0)
        else:
            init.zeros_(self.A_log)
        init_dt_bias_(self.dt_bias)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        f = at_least_fp32(self.f_proj(x)).view(B, T, self.num_v_heads, self.head_dim) + self.dt_bias.view(
            self.num_v_heads, self.head_dim)
        A = at_least_fp32(self.A_log).exp()[:, None]
        if self.lower_bound is None:
            return -A * F.softplus(f)
        return self.lower_bound * torch.sigmoid(A * f)

    def normalize(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_norm(o, self.g_proj(x).view(o.shape))

    def flops_per_token(self, seq_len: int, device) -> float:
        d, rank = self.q_proj.in_features, self.head_v_dim
        low_rank = 2 * (2 * d * rank + rank * (self.num_v_heads * self.head_dim + self.value_dim))  # f, g
        return super().flops_per_token(seq_len, device) + low_rank
