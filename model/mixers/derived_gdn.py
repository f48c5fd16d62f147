"""Derived GDN: softmax attention linearized into a gated delta rule with fixed 1/t gates.

Same parameters as the softmax mixer (q_proj, k_proj, v_proj, o_proj, rotary: model/mixers/attention_projections.py),
so a softmax checkpoint loads unchanged; only the core differs (model/ops/gated_delta/derived.py, derived_gated_delta_rule):

    ktil_t = k_t - mean(k_1..k_t),  vtil_t = v_t - mean(v_1..v_{t-1})
    A_t = A_{t-1} ((1 - 1/t) I - (1/t) ktil_t ktil_t^T) + (1/t) vtil_t ktil_t^T,  o_t = A_t q_t + mean(v_1..v_t)

with q, k after rotary, each scaled by d^-1/4. Option clamp_ktil (default true) rescales ktil_t to
|ktil_t|^2 <= 2t - 1, the largest norm for which the step does not amplify the state; false runs the
recursion exactly (large early keys then blow the state up, see tests/test_gated_delta.py).
Decoding keeps A [B, H, d, d], the running key and value sums and t in the cache: constant memory.
Init: softmax attention's (Llama's), the same parameters.

Padding: the op skips the pads (their own segments in cu_seqlens): its 1/t gates and running means count
tokens, so a pad must not be one. A prefill's cache keeps each row's last segment's state, t per row.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn

from model.mixers.attention_projections import (add_attention_projections, attention_projection_flops,
                                                forward_through_core, init_attention_projections)
from model.ops.gated_delta import CHUNK_SIZE, chunk_gated_delta_flops, chunk_size_on, derived_gated_delta_rule
from model.ops.gated_delta.context_parallel import derived_gated_delta_rule_cp
from model.ops.kernels import repeat_heads
from model.options import option
from model.registry import MIXERS

STATE_KEYS = ("A", "k_sum", "v_sum", "t")


@dataclass
class DerivedGDNOptions:
    clamp_ktil: bool = option(True)  # rescale ktil_t to |ktil_t|^2 <= 2t - 1; false: the exact recursion


@MIXERS.register("derived_gdn")
class DerivedGDN(nn.Module):
    parametrization = "llama"  # softmax's, whose projections it holds (model/config.py; docs/blocks.md#parametrization)
    output_projection = "o_proj"  # the nn.Linear the output leaves through: y = o_proj(core) (docs/extending.md)
    Options = DerivedGDNOptions
    context_exchange = ("the running key and value sums and the state map of each slice (H (2 K + K K + K V) per row: "
                        "model/ops/gated_delta/context_parallel.py)")

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        add_attention_projections(self, config)
        self.clamp_ktil = config.options_for_mixer("derived_gdn", DerivedGDNOptions).clamp_ktil

    def init_parameters(self) -> None:
        init_attention_projections(self)

    def forward(self, x: torch.Tensor, cache: dict | None = None, aux=None, segments=None) -> torch.Tensor:
        return forward_through_core(self, x, cache, aux, segments)

    def core(self, q, k, v, cache: dict | None, aux, segments=None) -> torch.Tensor:
        k, v = repeat_heads(k, self.num_heads), repeat_heads(v, self.num_heads)  # GQA
        if segments is not None and segments.context is not None:  # this rank's slice: t, sums and state passed along
            return derived_gated_delta_rule_cp(q, k, v, segments, clamp_ktil=self.clamp_ktil)
        if segments is not None:  # the recursion (and its 1/t gates) restarts at each segment; a cache keeps each
            # row's last one's (t then one count per row)
            o, state = derived_gated_delta_rule(*(segments.flatten(x) for x in (q, k, v)), clamp_ktil=self.clamp_ktil,
                                                cu_seqlens=segments.cu_seqlens, output_final_state=cache is not None)
            o = o.view(*q.shape[:3], -1)
            if state is not None:
                state = {key: val[segments.last_segment] for key, val in state.items()}
        else:
            state = None
            if cache is not None and "A" in cache:
                state = {key: cache[key] for key in STATE_KEYS}
            o, state = derived_gated_delta_rule(q, k, v, initial_state=state, output_final_state=cache is not None,
                                                clamp_ktil=self.clamp_ktil)
        if cache is not None:
            cache.update({key: val.detach() if torch.is_tensor(val) else val for key, val in state.items()})
        return o

    def flops_per_token(self, seq_len: int, device) -> float:
        """Projections plus the chunked gated-delta core per head at the chunk it runs at on `device` (matmul
        FLOPs; the O(d) running means are not counted)."""
        chunk = chunk_size_on(device, CHUNK_SIZE, seq_len)
        core = self.num_heads * chunk_gated_delta_flops(self.head_dim, self.head_dim, seq_len, chunk)
        return attention_projection_flops(self) + core
