"""Mamba2 block (mamba_ssm's Mamba2 module):

    [z, x, B, C, dt] = in_proj(u)                      widths d_inner, d_inner, G N, G N, H
    x, B, C = silu(causal_conv1d([x, B, C]))           depthwise, kernel 4, with bias
    y = SSD(x, dt, A, B, C) + D x                      dt <- softplus(dt + dt_bias), A = -exp(A_log)
    out = out_proj(RMSNorm_group(y * silu(z)))         norm after the gate, per group of d_inner / G

d_inner = expand * d_model, H = d_inner / head_dim. The gated norm's weight (d_inner / G wide) is
shared by the groups, where mamba_ssm has one per channel: identical at the default G = 1. Decoding keeps the conv window and the SSM state
[B, H, P, N] in the cache: constant memory per layer.

state_size defaults to 64 rather than mamba_ssm's 128: the SSD's FLOPs and state grow linearly in
N, and at d_model = 256 on CPU N = 64 keeps the scan at ~20% of the mixer's FLOPs (28% at N = 128)
with a state of H P N = 32K floats per layer (8 heads of 64).

Init as mamba_ssm (Mamba2.__init__ and MambaLMHeadModel's _init_weights): in_proj keeps PyTorch's
nn.Linear default, U(+-1/sqrt(d_model)); the conv kernel and bias PyTorch's nn.Conv1d default,
U(+-1/sqrt(conv_size)); softplus(dt_bias) ~ logU(1e-3, 1e-1) floored at 1e-4; D = 1; the norm's
weight 1; out_proj U(+-1/sqrt(d_inner)) * 1/sqrt(2 L) (rescale_prenorm_residual with an MLP per layer,
model/layers.py residual_scale). Not the generic N(0, 0.02): with it the SSM path C h starts weaker
against the D x skip (tests/test_init.py).
Ours differs on purpose in one place: A = -exp(A_log) with -A = 1..H as transformers' Mamba2, where
mamba_ssm draws -A ~ U(1, 16); with the few heads of a small model that draw decides whether any head
keeps a long memory (docs/studies/mqar.md#parametrization). transformers' Mamba2 also differs from
mamba_ssm in in_proj N(0, 0.1) and no residual rescale.

allow_neg_eigval (default false) follows Grazzi et al. 2025 ("Unlocking State-Tracking in Linear RNNs
Through Negative Eigenvalues", ICLR; their Mamba: the diagonal transition times 2, minus 1): the SSD's
transition a_t = exp(dt_t A) in (0, 1) becomes 2 exp(dt_t A) - 1 in (-1, 1), negative where
dt_t |A| > log 2, so that a head can flip its state's sign (parity). Parameters and init are unchanged.
The chunked scan carries the sign apart from log|a_t| (model/ops/ssd/chunk.py), so on CUDA it still runs in
fla's chunk_simple_gla, as with the option off; decoding steps the same signed recurrence.

Padding: the scan skips the pads (their own segments in cu_seqlens) and the conv drops their taps; zeroed
inputs would not do (the conv's bias would write into the state). A prefill's cache keeps each row's last
segment's state and conv inputs.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers import initialization as init

from model.layers import GatedRMSNorm, ShortConv, at_least_fp32, init_dt_bias_, init_fan_in_uniform_, residual_scale
from model.ops.ssd import mamba_chunk_scan, mamba_chunk_scan_flops, mamba_state_step
from model.ops.ssd.context_parallel import mamba_chunk_scan_cp
from model.options import bad_option, option
from model.registry import MIXERS


@dataclass
class Mamba2Options:
    expand: int = option(2, at_least=1)       # d_inner = expand * d_model
    head_dim: int = option(64, at_least=1)    # P; heads H = d_inner / head_dim
    state_size: int = option(64, at_least=1)  # N
    n_groups: int = option(1, at_least=1)     # G, dividing H
    conv_size: int = option(4, at_least=1)
    chunk_size: int = option(64, at_least=1)
    allow_neg_eigval: bool = option(False)  # transition 2 exp(dt A) - 1 in (-1, 1) (Grazzi et al. 2025)


@MIXERS.register("mamba2")
class Mamba2(nn.Module):
    Options = Mamba2Options
    parametrization = "mamba2"  # as transformers' Mamba2 (model/config.py; docs/blocks.md#parametrization)
    output_projection = "out_proj"  # y = out_proj(gated norm of the scan) (docs/extending.md)
    context_exchange = "the state map of each slice (H (1 + P N) per row: model/ops/ssd/context_parallel.py) and the conv's halo"

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        opts = config.options_for_mixer("mamba2", Mamba2Options)
        d = config.hidden_size
        self.d_inner = opts.expand * d
        self.head_dim, self.state_size, self.n_groups = opts.head_dim, opts.state_size, opts.n_groups
        self.chunk_size, self.allow_neg_eigval = opts.chunk_size, opts.allow_neg_eigval
        if self.d_inner % self.head_dim:
            raise bad_option("mamba2", "head_dim", self.head_dim, f"a divisor of d_inner={self.d_inner}")
        self.num_heads = self.d_inner // self.head_dim
        if self.num_heads % self.n_groups:
            raise bad_option("mamba2", "n_groups", self.n_groups, f"a divisor of num_heads={self.num_heads}")
        gn = self.n_groups * self.state_size
        self.in_proj = nn.Linear(d, 2 * self.d_inner + 2 * gn + self.num_heads, bias=False)
        self.conv = ShortConv(self.d_inner + 2 * gn, opts.conv_size, bias=True)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.norm = GatedRMSNorm(self.d_inner // self.n_groups, config.rms_norm_eps, norm_before_gate=False)
        self.out_proj = nn.Linear(self.d_inner, d, bias=False)
        self.residual_scale = residual_scale(config)

    def init_parameters(self) -> None:
        init_fan_in_uniform_(self.in_proj.weight, self.in_proj.in_features)
        kernel = self.conv.kernel_size  # depthwise: fan_in = kernel_size
        init_fan_in_uniform_(self.conv.conv.weight, kernel)
        init_fan_in_uniform_(self.conv.conv.bias, kernel)
        init_fan_in_uniform_(self.out_proj.weight, self.d_inner, self.residual_scale)
        init_dt_bias_(self.dt_bias)  # softplus(dt_bias) ~ logU(1e-3, 1e-1)
        init.copy_(self.A_log, torch.arange(1, self.num_heads + 1, dtype=torch.float32).log())  # -A = 1..H
        init.ones_(self.D)

    def forward(self, x: torch.Tensor, cache: dict | None = None, aux=None, segments=None) -> torch.Tensor:
        Bsz, T, _ = x.shape
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.state_size
        z, xBC, dt = self.in_proj(x).split([self.d_inner, self.d_inner + 2 * G * N, H], dim=-1)
        xs, B, C = self.conv(xBC, cache, segments=segments).split([self.d_inner, G * N, G * N], dim=-1)
        xs, B, C = xs.view(Bsz, T, H, P), B.view(Bsz, T, G, N), C.view(Bsz, T, G, N)
        A = -torch.exp(at_least_fp32(self.A_log))
        state = cache.get("ssm") if cache is not None else None
        if segments is not None and segments.context is not None:  # this rank's slice, the state passed along
            y = mamba_chunk_scan_cp(xs, dt, A, B, C, self.chunk_size, segments, D=self.D, dt_bias=self.dt_bias,
                                    dt_softplus=True, allow_neg_eigval=self.allow_neg_eigval)
        elif segments is not None:  # the state restarts at each segment; a cache keeps each row's last one's
            xs, dt, B, C = (segments.flatten(t) for t in (xs, dt, B, C))
            y = mamba_chunk_scan(xs, dt, A, B, C, self.chunk_size, D=self.D, dt_bias=self.dt_bias, dt_softplus=True,
                                 cu_seqlens=segments.cu_seqlens, allow_neg_eigval=self.allow_neg_eigval,
                                 return_final_states=cache is not None)
            if cache is not None:
                y, state = y[0], y[1][segments.last_segment]
        elif cache is not None and T == 1:
            if state is None:
                state = x.new_zeros(Bsz, H, P, N, dtype=torch.float32)
            y, state = mamba_state_step(xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], state, D=self.D,
                                        dt_bias=self.dt_bias, dt_softplus=True, allow_neg_eigval=self.allow_neg_eigval)
            y = y[:, None]
        else:
            y = mamba_chunk_scan(xs, dt, A, B, C, self.chunk_size, D=self.D, dt_bias=self.dt_bias,
                                 dt_softplus=True, initial_states=state, return_final_states=cache is not None,
                                 allow_neg_eigval=self.allow_neg_eigval)
            if cache is not None:
                y, state = y
        if cache is not None:
            cache["ssm"] = state.detach()
        y = self.norm(y.reshape(Bsz, T, G, -1), z.reshape(Bsz, T, G, -1))
        return self.out_proj(y.reshape(Bsz, T, self.d_inner))

    def flops_per_token(self, seq_len: int, device) -> float:
        """in_proj, conv, the SSD scan on `device` (model/ops/ssd/chunk.py mamba_chunk_scan_flops), D skip and out_proj."""
        proj = 2 * self.in_proj.in_features * (self.in_proj.out_features + self.d_inner)
        conv = 2 * self.conv.kernel_size * self.conv.conv.in_channels
        ssd = mamba_chunk_scan_flops(seq_len, self.chunk_size, self.n_groups, self.num_heads, self.head_dim,
                                     self.state_size, device)
        return proj + conv + ssd + 2 * self.d_inner
