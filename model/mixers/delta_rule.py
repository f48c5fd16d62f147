"""DeltaRuleBlock, the block the delta-rule mixers share: Gated DeltaNet (model/mixers/gdn.py), DeltaNet
(deltanet.py), KDA (kda.py), GDN-2 (gdn2.py) and Gated DeltaProduct (deltaproduct.py), with its options
(DeltaRuleOptions). Each mixer adds its decay and output norm (and their init):

    q, k = l2norm(silu(conv(W_q x))), l2norm(silu(conv(W_k x)))   per head, x / sqrt(sum x^2 + 1e-6)
    v = silu(conv(W_v x)),  beta = sigmoid(W_b x)
    h_t = h_{t-1} exp(g_t) + k_t u_t^T, u_t = beta_t (v_t - (h_{t-1} exp(g_t))^T k_t),  o_t = h_t^T q_t / sqrt(d_k)
    y = W_o normalize(o, x)

use_short_conv=False (fla's option): q, k, v = silu(W x), without the short convs (no halos under context
parallelism, no conv tails in a decoding cache).

allow_neg_eigval (as fla's, default off): beta = 2 sigmoid(W_b x) in (0, 2), so the transition I - beta_t k_t k_t^T
has eigenvalue 1 - beta_t in (-1, 1) along k_t (Grazzi et al. 2025, "Unlocking State-Tracking in Linear RNNs
Through Negative Eigenvalues", ICLR: parity and modular counting need a negative eigenvalue).

Value heads may outnumber query/key heads (num_v_heads, GQA-style): each q/k head then serves
num_v_heads / num_heads consecutive value heads. Decoding keeps the three conv tails and the
recurrent state h [B, Hv, d_k, d_v] in the cache: constant memory.

Init: the projections and the short-conv kernels N(0, initializer_range) as fla's (conv_init=uniform: nn.Conv1d's
default U(+-1/sqrt(conv_size)), docs/studies/gdn_language.md). One difference on purpose, in every DeltaRuleBlock:
o_proj gets std * 1/sqrt(2 L), shared by every block (model/layers.py residual_scale; fla's
prenorm_residual_strategy="rescale" does the same with a kaiming base).

Padding, in every DeltaRuleBlock: the delta rule skips the pads (their own segments in cu_seqlens) and the short
convs drop their taps, as for packed documents; a prefill's cache keeps each row's last segment's state and conv
inputs.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import initialization as init

from model.layers import ShortConv, at_least_fp32, init_fan_in_uniform_, residual_scale
from model.ops.gated_delta import (CHUNK_SIZE, chunk_gated_delta_flops, chunk_gated_delta_rule, chunk_size_on,
                                   fused_recurrent_gated_delta_rule)
from model.ops.gated_delta.context_parallel import gated_delta_rule_cp
from model.ops.kernels import kernel_runs, repeat_heads
from model.options import bad_option, option


@dataclass
class DeltaRuleOptions:
    num_heads: int | None = option(None, at_least=1)    # None: the config's num_attention_heads
    head_dim: int | None = option(None, at_least=1)     # None: hidden_size / num_heads
    expand_v: float = option(1, above=0)                # value head width = expand_v * head_dim
    conv_size: int = option(4, at_least=1)
    use_short_conv: bool = option(True)  # False: q, k, v = silu(W x) without the short convs (fla's use_short_conv;
    # DeltaProduct's state-tracking model)
    chunk_size: int = option(CHUNK_SIZE, at_least=1)
    allow_neg_eigval: bool = option(False)              # beta = 2 sigmoid(W_b x) in (0, 2) (Grazzi et al. 2025)
    conv_init: str = option("normal", choices=("normal", "uniform"))  # short-conv kernels: N(0, initializer_range)
    # as fla and Qwen3-Next, or U(+-1/sqrt(conv_size)) (nn.Conv1d's default, zoology's) (docs/studies/gdn_language.md)


class DeltaRuleBlock(nn.Module):
    """What the delta-rule mixers share: q, k, v through short convs (q, k L2-normalised per head), beta, the
    delta rule (chunked in training and prefill, per token when decoding one token, restarted at each document),
    the per-head output norm and W_o. A subclass builds its decay and its output norm, initialises them
    beside init_projections / init_convs_and_output in its init_parameters, and gives
    decay(x) -> g (None, [B, T, Hv] or [B, T, Hv, d_k]: model/ops/gated_delta/) and
    normalize(o [B, T, Hv, d_v], x) -> the normed (and gated) o."""

    parametrization = "fla"  # as fla's models of these layers (model/config.py; docs/blocks.md#parametrization)
    output_projection = "o_proj"  # y = o_proj(the normed core) (docs/extending.md)
    # under context parallelism (model/ops/gated_delta/context_parallel.py): each slice's state map, the short convs' halos
    context_exchange = "the state map of each slice (H (K K + K V) per row) and the short convs' halos"

    erase_per_channel = False  # whether b_proj gives an erase gate per key channel (GDN-2's) or one beta per value head

    def __init__(self, config, layer_idx: int, name: str, opts: DeltaRuleOptions, num_v_heads: int | None = None,
                 steps: int = 1):
        super().__init__()
        self.steps = steps  # delta-rule steps per token, each with its key, value and beta (DeltaProduct's)
        d = config.hidden_size
        self.layer_idx = layer_idx
        self.num_heads = opts.num_heads or config.num_attention_heads
        self.head_dim = opts.head_dim or d // self.num_heads
        self.expand_v = opts.expand_v
        self.num_v_heads = num_v_heads or self.num_heads
        self.conv_size, self.conv_init = opts.conv_size, opts.conv_init
        self.chunk_size = opts.chunk_size
        self.allow_neg_eigval = opts.allow_neg_eigval
        if self.num_v_heads % self.num_heads:
            raise bad_option(name, "num_v_heads", self.num_v_heads, f"a multiple of num_heads={self.num_heads}")
        self.head_v_dim = int(self.head_dim * self.expand_v)
        self.key_dim, self.value_dim = self.num_heads * self.head_dim, self.num_v_heads * self.head_v_dim
        n = self.steps
        self.q_proj = nn.Linear(d, self.key_dim, bias=False)
        self.k_proj = nn.Linear(d, self.key_dim * n, bias=False)
        self.v_proj = nn.Linear(d, self.value_dim * n, bias=False)
        self.b_proj = nn.Linear(d, (self.key_dim if self.erase_per_channel else self.num_v_heads) * n, bias=False)
        self.q_conv, self.k_conv, self.v_conv = ((ShortConv(self.key_dim, self.conv_size),
                                                  ShortConv(self.key_dim * n, self.conv_size),
                                                  ShortConv(self.value_dim * n, self.conv_size))
                                                 if opts.use_short_conv else (None, None, None))
        self.o_proj = nn.Linear(self.value_dim, d, bias=False)
        self.init_std, self.residual_scale = config.initializer_range, residual_scale(config)

    def init_projections(self, *projections: nn.Linear) -> None:
        """The input projections, in the subclass's order (so that one seed gives one init): N(0, initializer_range)."""
        for proj in projections:
            init.normal_(proj.weight, mean=0.0, std=self.init_std)

    def short_convs(self) -> list[ShortConv]:
        return [conv for conv in (self.q_conv, self.k_conv, self.v_conv) if conv is not None]

    def init_convs_and_output(self) -> None:
        for conv in self.short_convs():
            if self.conv_init == "uniform":  # depthwise: fan_in = kernel size
                init_fan_in_uniform_(conv.conv.weight, self.conv_size)
            else:
                init.normal_(conv.conv.weight, mean=0.0, std=self.init_std)
        init.normal_(self.o_proj.weight, mean=0.0, std=self.init_std * self.residual_scale)

    def forward(self, x: torch.Tensor, cache: dict | None = None, aux=None, segments=None) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hv, K, V, n = self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim, self.steps
        q, k, v = (F.silu(proj(x)) if conv is None else conv(proj(x), cache, key, segments)
                   for proj, conv, key in ((self.q_proj, self.q_conv, "conv_q"), (self.k_proj, self.k_conv, "conv_k"),
                                           (self.v_proj, self.v_conv, "conv_v")))
        q, k = q.view(B, T, H, K), k.reshape(B, T * n, H, K)  # a token's n steps in a row
        v = v.reshape(B, T * n, Hv, V)
        q, k = ((at_least_fp32(t) / torch.sqrt(at_least_fp32(t).pow(2).sum(-1, keepdim=True) + 1e-6)).to(v.dtype)
                for t in (q, k))
        q, k = repeat_heads(q, Hv), repeat_heads(k, Hv)  # each q, k head shared by Hv / H value heads
        beta, write = self.gates(x)
        inputs = (q, k, v, self.decay(x), beta, write)
        state = cache.get("state") if cache is not None else None
        if segments is not None and segments.context is not None:  # this rank's slice, the state passed along
            o = self.rule_cp(*inputs, segments)
        elif segments is not None:  # the state restarts at each segment; a cache keeps each row's last one's
            o, state = self.rule(*(None if t is None else segments.flatten(t) for t in inputs),
                                 cu_seqlens=segments.cu_seqlens, output_final_state=cache is not None)
            o, state = o.view(B, T, Hv, V), None if state is None else state[segments.last_segment]
        else:
            o, state = self.rule(*inputs, initial_state=state, output_final_state=cache is not None,
                                 decoding=cache is not None and T == 1)
        if cache is not None:
            cache["state"] = state.detach()
        return self.o_proj(self.normalize(o.to(x.dtype), x).reshape(B, T, Hv * V))

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(beta [B, T n, Hv], None): one beta per value head and step, erasing and writing (GDN-2 overrides)."""
        beta = at_least_fp32(self.b_proj(x)).sigmoid() * (2 if self.allow_neg_eigval else 1)
        return beta.view(x.shape[0], -1, self.num_v_heads), None

    def rule(self, q, k, v, g, beta, write, initial_state=None, output_final_state=False, cu_seqlens=None,
             decoding=False):
        """The delta rule over whole sequences (model/ops/gated_delta): per token when decoding one, else chunked."""
        if decoding:
            return fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                    output_final_state=output_final_state, write=write)
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, chunk_size=self.chunk_size,
                                      output_final_state=output_final_state, cu_seqlens=cu_seqlens, write=write)

    def rule_cp(self, q, k, v, g, beta, write, segments):
        """The delta rule over this rank's slice under context parallelism, the state passed along."""
        return gated_delta_rule_cp(q, k, v, g, beta, segments, chunk_size=self.chunk_size, write=write)

    def flops_per_token(self, seq_len: int, device) -> float:
        """q, k, v, o, b projections, the short convs and the delta rule at the chunk it runs at on `device` (fla's on
        CUDA); a subclass adds its decay and gate."""
        proj = 2 * sum(m.weight.numel() for m in (self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.o_proj))
        conv = 2 * sum(c.conv.weight.numel() for c in self.short_convs())
        steps = seq_len * self.steps  # the rule runs over every step of every token
        # the PyTorch form takes its output side at each token's query row alone (one step of self.steps); fla's at every step
        kernel = "fla.ops.kda" if self.per_channel_decay else "fla.ops.gated_delta_rule"
        every = 1 if kernel_runs(kernel, device) else self.steps
        chunk = chunk_size_on(device, self.chunk_size, steps, self.per_channel_decay, query_every=every)
        core = self.num_v_heads * self.steps * chunk_gated_delta_flops(self.head_dim, self.head_v_dim, steps, chunk, every)
        return proj + conv + core

    per_channel_decay = False  # whether decay(x) gives one decay per key channel (the op's costlier form)
