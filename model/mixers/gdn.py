"""Gated DeltaNet (the flash-linear-attention GatedDeltaNet layer), on DeltaRuleBlock (model/mixers/delta_rule.py),
the block it shares with DeltaNet, KDA, GDN-2 and Gated DeltaProduct:

    q, k = l2norm(silu(conv(W_q x))), l2norm(silu(conv(W_k x)))   per head, x / sqrt(sum x^2 + 1e-6)
    v = silu(conv(W_v x)),  beta = sigmoid(W_b x),  g = -exp(A_log) softplus(W_a x + dt_bias)
    h_t = h_{t-1} exp(g_t) + k_t u_t^T, u_t = beta_t (v_t - (h_{t-1} exp(g_t))^T k_t),  o_t = h_t^T q_t / sqrt(d_k)
    y = W_o [RMSNorm(o) * silu(W_g x)]   (per-head norm before the gate)

allow_neg_eigval, value heads (num_v_heads), decoding and padding: DeltaRuleBlock's (model/mixers/delta_rule.py).

Init as fla's GatedDeltaNetPreTrainedModel: every projection and the short-conv kernels N(0, initializer_range)
(fla's ShortConvolution is an nn.Conv1d, which its _init_weights draws with the projections), A ~ U(0, 16) stored
as log A, softplus(dt_bias) ~ logU(1e-3, 1e-1) floored at 1e-4, the gated norm's weight 1. conv_init=uniform keeps
nn.Conv1d's default U(+-1/sqrt(conv_size)) instead, as zoology's MQAR models leave fla's convs and as ours did
before: on the default corpus it leaves gdn well behind Qwen3-Next's GDN layers at equal steps, and on MQAR it
is no better (docs/studies/gdn_language.md). One difference on purpose, DeltaRuleBlock's: o_proj gets
std * 1/sqrt(2 L) (model/layers.py residual_scale).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.layers import GatedRMSNorm, RMSNorm, at_least_fp32, init_A_log_, init_dt_bias_
from model.mixers.delta_rule import DeltaRuleBlock, DeltaRuleOptions
from model.options import option
from model.registry import MIXERS


@dataclass
class GDNOptions(DeltaRuleOptions):
    expand_v: float = option(2, above=0)
    num_v_heads: int | None = option(None, at_least=1)  # None: num_heads; else a multiple of it


@MIXERS.register("gdn")
class GatedDeltaNet(DeltaRuleBlock):
    Options = GDNOptions

    def __init__(self, config, layer_idx: int = 0, name: str = "gdn", steps: int = 1, forget_gate: bool = True,
                 output_gate: bool = True):
        opts = config.options_for_mixer(name, self.Options)
        super().__init__(config, layer_idx, name, opts, opts.num_v_heads, steps)
        d = config.hidden_size
        # forget_gate=False: no decay (g = 0); output_gate=False: y = W_o RMSNorm(o) (fla's use_forget_gate and
        # use_output_gate, which DeltaProduct's options expose)
        self.a_proj = nn.Linear(d, self.num_v_heads, bias=False) if forget_gate else None
        self.g_proj = nn.Linear(d, self.value_dim, bias=False) if output_gate else None
        if forget_gate:
            self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
            self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.o_norm = (GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, norm_before_gate=True) if output_gate
                       else RMSNorm(self.head_v_dim, config.rms_norm_eps))

    def init_parameters(self) -> None:
        self.init_projections(*(p for p in (self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj,
                                            self.g_proj) if p is not None))
        self.init_convs_and_output()
        if self.a_proj is not None:
            init_A_log_(self.A_log, 0.0, 16.0)
            init_dt_bias_(self.dt_bias)

    def decay(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.a_proj is None:
            return None
        return -at_least_fp32(self.A_log).exp() * F.softplus(at_least_fp32(self.a_proj(x)) + self.dt_bias)

    def normalize(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_norm(o) if self.g_proj is None else self.o_norm(o, self.g_proj(x).view(o.shape))

    def flops_per_token(self, seq_len: int, device) -> float:
        """Projections, short convs, and the chunked gated delta rule per value head at the chunk it runs at
        on `device` (fla's on CUDA)."""
        d = self.q_proj.in_features
        gates = sum(p.weight.numel() for p in (self.g_proj, self.a_proj) if p is not None)
        return super().flops_per_token(seq_len, device) + 2 * gates
