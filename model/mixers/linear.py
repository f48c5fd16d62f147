"""Linear attention (Katharopoulos et al. 2020), the seeds' baseline:

    q, k, v = softmax attention's projections (rotary applied), q, k <- phi(q), phi(k)
    S_t = S_{t-1} + k_t v_t^T,  o_t = S_t^T (q_t / sqrt(d))  [/ ((q_t / sqrt(d)) . sum_{i<=t} k_i + eps)]

phi is `elu1` (elu(x) + 1, positive) or `identity`; `normalize` divides by the running key sum
(needs the positive phi). q_proj/k_proj/v_proj/o_proj and rotary are softmax attention's
(model/mixers/attention_projections.py), so a softmax checkpoint loads unchanged; phi is applied after
rotary, to the q, k that checkpoint was trained to produce (as in the Hedgehog / LoLCATs conversions of
RoPE models). With GQA, k and v are repeated to the query heads. Decoding keeps S [B, H, d, d] (and the
key sum) in the cache. Init: softmax attention's (Llama's), the same parameters.

Padding: the op skips the pads (their own segments in cu_seqlens); zeroed inputs would not do, since phi = elu + 1
is 1 at 0 and would add each pad to the key sum. A prefill's cache keeps each row's last segment's state.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.mixers.attention_projections import (add_attention_projections, attention_projection_flops,
                                                forward_through_core, init_attention_projections)
from model.ops.kernels import repeat_heads
from model.ops.linear_attention import chunk_linear_attn, chunk_linear_attn_flops
from model.ops.linear_attention.context_parallel import chunk_linear_attn_cp
from model.options import bad_option, option
from model.registry import MIXERS

FEATURE_MAPS = {"identity": lambda x: x, "elu1": lambda x: F.elu(x) + 1}


@dataclass
class LinearOptions:
    feature_map: str = option("elu1", choices=tuple(FEATURE_MAPS))  # phi
    normalize: bool = option(True)  # divide by the running key sum (needs the positive phi, elu1)
    chunk_size: int = option(64, at_least=1)


@MIXERS.register("linear")
class LinearAttention(nn.Module):
    parametrization = "llama"  # softmax's, whose projections it holds (model/config.py; docs/blocks.md#parametrization)
    output_projection = "o_proj"  # the nn.Linear the output leaves through: y = o_proj(core) (docs/extending.md)
    Options = LinearOptions
    context_exchange = "the state and key sum of each slice (H K (V + 1) per row: model/ops/linear_attention/context_parallel.py)"

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        add_attention_projections(self, config)
        opts = config.options_for_mixer("linear", LinearOptions)
        if opts.normalize and opts.feature_map != "elu1":
            raise bad_option("linear", "normalize", opts.normalize, f"false with feature_map={opts.feature_map!r} "
                             "(the normaliser needs the positive map, elu1)")
        self.feature_map = FEATURE_MAPS[opts.feature_map]
        self.normalize = opts.normalize
        self.chunk_size = opts.chunk_size

    def init_parameters(self) -> None:
        init_attention_projections(self)

    def forward(self, x: torch.Tensor, cache: dict | None = None, aux=None, segments=None) -> torch.Tensor:
        return forward_through_core(self, x, cache, aux, segments)

    def core(self, q, k, v, cache: dict | None, aux, segments=None) -> torch.Tensor:
        q, k = self.feature_map(q), self.feature_map(k)
        k, v = repeat_heads(k, self.num_heads), repeat_heads(v, self.num_heads)  # GQA
        if segments is not None and segments.context is not None:  # this rank's slice, the state passed along
            return chunk_linear_attn_cp(q, k, v, segments, normalize=self.normalize, chunk_size=self.chunk_size)
        if segments is not None:  # the state (and the normaliser's key sum) restarts at each segment; a cache keeps
            # each row's last one's
            o, state = chunk_linear_attn(*(segments.flatten(x) for x in (q, k, v)), normalize=self.normalize,
                                         chunk_size=self.chunk_size, cu_seqlens=segments.cu_seqlens,
                                         output_final_state=cache is not None)
            o = o.view(*q.shape[:3], -1)
            if state is not None:
                state = tuple(s[segments.last_segment] for s in state) if self.normalize else state[segments.last_segment]
        else:
            state = None
            if cache is not None and "state" in cache:
                state = (cache["state"], cache["key_sum"]) if self.normalize else cache["state"]
            o, state = chunk_linear_attn(q, k, v, initial_state=state, output_final_state=cache is not None,
                                         normalize=self.normalize, chunk_size=self.chunk_size)
        if cache is not None:
            if self.normalize:
                cache["state"], cache["key_sum"] = state[0].detach(), state[1].detach()
            else:
                cache["state"] = state.detach()
        return o

    def flops_per_token(self, seq_len: int, device) -> float:
        """Projections plus the chunked linear-attention core on `device` (k, v repeated to all heads)."""
        core = chunk_linear_attn_flops(seq_len, self.num_heads, self.head_dim, self.head_dim, self.chunk_size, device)
        return attention_projection_flops(self) + core
