"""Softmax attention with GQA and RoPE: o = softmax(q k^T / sqrt(d) + causal mask) v, through
F.scaled_dot_product_attention. Its projections (q_proj, k_proj, v_proj, o_proj), rotary and their
init (Llama's, o_proj's residual scale apart) are model/mixers/attention_projections.py's, the part it shares
with the mixers that replace only the core (derived_gdn, linear, dsa), so a softmax checkpoint loads into
them unchanged.

With DocumentSegments (document masking) rotary runs at the segments' position_ids and a query
attends only to its own segment (SDPA with the block-causal mask on CPU, FlexAttention with its
BlockMask on CUDA).

Padding (a padded batch's pads are segments of their own, DocumentSegments.padded): masking the pad keys is
all it takes, the segments' mask in a forward and a prefill; a decode cache keeps each row's start (last_start)
and its later calls mask the keys before it and count rotary from it.
"""
from functools import cache

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.layers import KVBuffer
from model.mixers.attention_projections import (add_attention_projections, attention_projection_flops,
                                                forward_through_core, init_attention_projections)
from model.segments import DocumentSegments
from model.ops.attention.context_parallel import causal_attention_after
from model.registry import MIXERS


@MIXERS.register("softmax")
class SoftmaxAttention(nn.Module):
    parametrization = "llama"  # the model around it starts as Llama's (model/config.py; docs/blocks.md#parametrization)
    output_projection = "o_proj"  # the nn.Linear the output leaves through: y = o_proj(core) (docs/extending.md)
    # under context parallelism: every rank's keys and values (all-gather), each query attending to those up to
    # its position in its own document (DocumentSegments.attention_mask of this rank's slice)
    context_exchange = "keys and values (all-gather: 2 Hkv D per token)"

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        add_attention_projections(self, config)

    def init_parameters(self) -> None:
        init_attention_projections(self)

    def forward(self, x: torch.Tensor, cache: dict | None = None, aux=None,
                segments: DocumentSegments | None = None) -> torch.Tensor:
        return forward_through_core(self, x, cache, aux, segments)

    def core(self, q, k, v, cache: dict | None, aux, segments: DocumentSegments | None = None) -> torch.Tensor:
        if segments is not None and segments.context is not None:  # the keys and values of the slices up to this one
            k, v = (segments.context.gather_sequence(x, segments.end) for x in (k, v))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        if cache is not None:
            if "k" not in cache:
                cache["k"], cache["v"] = KVBuffer(dim=2), KVBuffer(dim=2)
            k, v = cache["k"].append(k), cache["v"].append(v)
        o = attend(q, k, v, segments, None if cache is None or segments is not None else cache.get("start"))
        return o.transpose(1, 2)

    def flops_per_token(self, seq_len: int, device) -> float:
        """Projections plus q.k and a.v over the causal context, (seq_len + 1) / 2 keys on average (as a causal
        kernel skips the masked half; the same on every device)."""
        return attention_projection_flops(self) + 2 * 2 * self.num_heads * self.head_dim * (seq_len + 1) / 2


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: DocumentSegments | None = None,
           first_key: torch.Tensor | None = None) -> torch.Tensor:
    """Causal SDPA for q [B, H, Tq, D] whose Tq positions are the last ones of k, v [B, Hkv, Tk, D];
    with segments, causal within each document segment only (Tq = Tk, or under context parallelism this rank's
    slice of queries over the keys up to its end); with first_key [B] (a cache's later calls, continuing each row's
    last segment), over the keys from there."""
    Tq, Tk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if first_key is not None:
        keys = torch.arange(Tk, device=q.device)
        mask = (keys >= first_key[:, None])[:, None, None] & (keys <= keys[Tk - Tq:, None])  # [B, 1, Tq, Tk]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if segments is not None:
        if q.is_cuda:
            return _flex_attention()(q, k, v, block_mask=segments.attention_mask, enable_gqa=gqa)
        if segments.context is not None and segments.one_document:  # no mask to hold (model/ops/attention/context_parallel.py)
            return causal_attention_after(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=segments.attention_mask, enable_gqa=gqa)
    if Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if Tq == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


@cache
def _flex_attention():
    """torch's FlexAttention, compiled (uncompiled it materialises the full score matrix)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)
