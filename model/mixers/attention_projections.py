"""Softmax attention's projections, the part that softmax (softmax.py) and the mixers that replace only its core
(linear.py, derived_gdn.py, dsa.py) each hold: q_proj, k_proj, v_proj, o_proj and rotary. They are set on the
mixer itself, so that every parameter's name is the mixer's own (q_proj.weight, ...) in each of them, and a softmax
checkpoint loads into any of them unchanged (linearization maps teacher to student by these names:
training/objectives/linearize/). The functions here take that mixer.

Init as Llama (transformers' LlamaPreTrainedModel): every projection N(0, initializer_range). Ours differs on
purpose in one place, shared by every block: o_proj, which writes into the residual stream, gets
std * 1/sqrt(2 L) (model/layers.py residual_scale) unless the model's parametrization is Llama's own
(model/config.py).
"""
import torch
import torch.nn as nn
from transformers import initialization as init

from model.layers import RotaryEmbedding, residual_scale
from model.segments import DocumentSegments, continued_positions


def add_attention_projections(mixer: nn.Module, config) -> None:
    """Sets on `mixer` q_proj, k_proj, v_proj, o_proj (nn.Linear, no bias) and rotary (RoPE over head_dim), with
    what the functions below read: num_heads, num_kv_heads, head_dim, init_std, residual_scale."""
    d = config.hidden_size
    mixer.num_heads = config.num_attention_heads
    mixer.num_kv_heads = config.num_key_value_heads
    mixer.head_dim = config.head_dim
    mixer.q_proj = nn.Linear(d, mixer.num_heads * mixer.head_dim, bias=False)
    mixer.k_proj = nn.Linear(d, mixer.num_kv_heads * mixer.head_dim, bias=False)
    mixer.v_proj = nn.Linear(d, mixer.num_kv_heads * mixer.head_dim, bias=False)
    mixer.o_proj = nn.Linear(mixer.num_heads * mixer.head_dim, d, bias=False)
    mixer.rotary = RotaryEmbedding(mixer.head_dim, config.rope_theta)
    mixer.init_std, mixer.residual_scale = config.initializer_range, residual_scale(config)


def init_attention_projections(mixer: nn.Module) -> None:
    for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj):
        init.normal_(proj.weight, mean=0.0, std=mixer.init_std)
    init.normal_(mixer.o_proj.weight, mean=0.0, std=mixer.init_std * mixer.residual_scale)


def project_qkv(mixer: nn.Module, x: torch.Tensor, offset: int = 0, position_ids: torch.Tensor | None = None):
    """q [B, T, H, D], k, v [B, T, Hkv, D] of x [B, T, d], rotary applied at position_ids [B, T] if given, else
    at positions offset..offset+T-1."""
    B, T, _ = x.shape
    q = mixer.q_proj(x).view(B, T, mixer.num_heads, mixer.head_dim)
    k = mixer.k_proj(x).view(B, T, mixer.num_kv_heads, mixer.head_dim)
    v = mixer.v_proj(x).view(B, T, mixer.num_kv_heads, mixer.head_dim)
    angles = torch.promote_types(x.dtype, torch.float32)  # fp32, fp64 for fp64 models
    if position_ids is None:
        cos, sin = mixer.rotary.cos_sin(offset, T, x.device, angles)
    else:
        cos, sin = mixer.rotary.cos_sin_at(position_ids, angles)
    return mixer.rotary.apply(q, cos, sin), mixer.rotary.apply(k, cos, sin), v


def forward_through_core(mixer: nn.Module, x: torch.Tensor, cache: dict | None = None, aux=None,
                         segments: DocumentSegments | None = None) -> torch.Tensor:
    """The forward of a mixer that replaces only softmax's core: y = o_proj(mixer.core(q, k, v, cache, aux,
    segments) [B, T, H, D]), q, k, v projected at the positions the cache or the document segments continue."""
    B, T, _ = x.shape
    offset = cache["offset"] if cache is not None else 0
    q, k, v = project_qkv(mixer, x, offset, continued_positions(cache, segments, T, x.device))
    o = mixer.core(q, k, v, cache, aux, segments)  # [B, T, H, D]
    return mixer.o_proj(o.reshape(B, T, -1))


def attention_projection_flops(mixer: nn.Module) -> float:
    """Per token, q_proj, k_proj, v_proj and o_proj: 2 d (2 H + 2 Hkv) head_dim."""
    return 2 * mixer.q_proj.in_features * (2 * mixer.num_heads + 2 * mixer.num_kv_heads) * mixer.head_dim
