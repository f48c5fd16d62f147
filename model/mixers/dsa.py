"""DeepSeek Sparse Attention (DeepSeek-V3.2): softmax attention in which each query attends only to the
top-k earlier tokens picked by a lightning indexer,

    I[t, s] = sum_{j <= H_I} w[t, j] H_I^-1/2 relu(q_i[t, j] . k_i[s] d_I^-1/2),    s <= t,

with H_I indexer heads (q_i and w from the query token), one shared LayerNorm'd key k_i per token,
and partial rotary on q_i, k_i. The projections and rotary are softmax attention's
(model/mixers/attention_projections.py), so a softmax checkpoint loads unchanged; all new parameters
live under `indexer`.

The indexer learns from L_I = mean_t KL(p_t || softmax(I_t)), p_t the main attention probabilities
averaged over heads (detached), reported as aux loss "dsa/indexer_kl". Its input is detached, so the
LM loss never reaches the indexer and L_I never reaches the rest. Stages (option `stage`):
  warmup: dense attention; L_I over all causal keys (the trainer freezes all but the indexer);
  sparse: attention over the top-k keys only; L_I over the selected keys. While a query sees <= topk
          keys it selects them all, so attention is exactly dense (and computed densely) there.
In eval mode the layer also reports "dsa/topk_attention_recall": the share of the dense attention
mass (head-averaged) that the selected keys hold. Cached decoding reports nothing.

Init as DeepSeek-V3.2 (transformers' DeepseekV32PreTrainedModel): the main projections as
softmax attention's (Llama), the indexer's q_proj, k_proj and w_proj N(0, initializer_range), its k_norm
to identity (weight 1, bias 0).

Padding: as softmax, pad keys masked (the indexer's candidates and the attention's, by segment ids), a decode
cache keeping each row's start; the indexer loss and recall average over real queries only.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers import initialization as init

from model.layers import KVBuffer, RotaryEmbedding
from model.segments import DocumentSegments, continued_positions
from model.mixers.attention_projections import (add_attention_projections, attention_projection_flops,
                                                init_attention_projections, project_qkv)
from model.mixers.softmax import attend
from model.ops.sparse_attention import (Selection, dense_attention_probs, index_scores, index_scores_at, index_topk,
                                        selected_attention)
from model.ops.sparse_attention.context_parallel import fetch_selected
from model.options import bad_option, option
from model.registry import MIXERS

STAGES = ("warmup", "sparse")


@dataclass
class DSAOptions:
    topk: int = option(64, at_least=1)             # keys each query attends to (sparse stage)
    index_heads: int = option(4, at_least=1)       # H_I
    index_head_dim: int = option(32, at_least=1)   # d_I
    index_rope_dim: int = option(16, at_least=2)   # rotary on the first index_rope_dim channels: even, <= d_I
    stage: str = option("sparse", choices=STAGES)
    indexer_loss_coef: float = option(1.0, at_least=0)


def indexer_kl(p: torch.Tensor, logits: torch.Tensor, aux=None, real: torch.Tensor | None = None) -> torch.Tensor:
    """mean over queries of KL(p || softmax(logits)) = sum_s p_s (log p_s - log_softmax(logits)_s), over
    the last dim; -inf logits mark keys outside the candidate set (where p = 0). With aux (AuxCollector) the
    mean is over the whole sequences' queries under context parallelism; with real [B, T] (a padded batch) over
    the real queries."""
    log_q = logits.log_softmax(-1).masked_fill(logits == float("-inf"), 0)
    kl = (torch.xlogy(p, p) - p * log_q).sum(-1)
    kl = kl.flatten() if real is None else kl[real]
    return kl.mean() if aux is None else aux.sequence_mean(kl)


class LightningIndexer(nn.Module):
    """q_i [B, T, H_I, d_I] (scaled by d_I^-1/2), k_i [B, T, d_I], w [B, T, H_I] (scaled by H_I^-1/2)."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int, rope_dim: int, rope_theta: float):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q_proj = nn.Linear(hidden_size, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim)
        self.w_proj = nn.Linear(hidden_size, heads, bias=False)
        self.rotary = RotaryEmbedding(rope_dim, rope_theta)  # on the first rope_dim channels only

    def flops_per_token(self, seq_len: int, device) -> float:
        """Its projections, and the scores over the causal context ((L + 1) / 2 keys on average, H_I (d_I + 1)
        multiply-adds per key: the dot products and the head-weighted sum)."""
        d = self.q_proj.in_features
        proj = 2 * d * (self.heads * self.head_dim + self.head_dim + self.heads)
        return proj + 2 * self.heads * (self.head_dim + 1) * (seq_len + 1) / 2

    def forward(self, x: torch.Tensor, offset: int, position_ids: torch.Tensor | None = None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim)
        k = self.k_norm(self.k_proj(x)).view(B, T, 1, self.head_dim)
        if position_ids is None:
            cos, sin = self.rotary.cos_sin(offset, T, x.device)
        else:  # document masking: positions restart per document
            cos, sin = self.rotary.cos_sin_at(position_ids)
        q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        return q * self.head_dim**-0.5, k[:, :, 0], self.w_proj(x) * self.heads**-0.5


@MIXERS.register("dsa")
class DSAttention(nn.Module):
    parametrization = "llama"  # softmax's, whose projections it holds (model/config.py; docs/blocks.md#parametrization)
    output_projection = "o_proj"  # the nn.Linear the output leaves through: y = o_proj(attention) (docs/extending.md)
    may_leave_parameters_unused = True  # the stage decides which of attention / indexer get gradients
    Options = DSAOptions
    context_exchange = ("the indexer keys (all-gather: d_I per token) and, in the sparse stage, the selected keys and "
                        "values of earlier ranks (each selected key once), in warm-up all keys and values")

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        add_attention_projections(self, config)
        opts = config.options_for_mixer("dsa", DSAOptions)
        if opts.index_rope_dim % 2 or opts.index_rope_dim > opts.index_head_dim:
            raise bad_option("dsa", "index_rope_dim", opts.index_rope_dim,
                             f"even and in [2, index_head_dim={opts.index_head_dim}]")
        self.topk, self.stage, self.indexer_loss_coef = opts.topk, opts.stage, opts.indexer_loss_coef
        self.indexer = LightningIndexer(config.hidden_size, opts.index_heads, opts.index_head_dim,
                                        opts.index_rope_dim, config.rope_theta)

    def init_parameters(self) -> None:
        init_attention_projections(self)
        ix = self.indexer
        for proj in (ix.q_proj, ix.k_proj, ix.w_proj):
            init.normal_(proj.weight, mean=0.0, std=self.init_std)
        init.ones_(ix.k_norm.weight)
        init.zeros_(ix.k_norm.bias)

    def forward(self, x: torch.Tensor, cache: dict | None = None, aux=None,
                segments: DocumentSegments | None = None) -> torch.Tensor:
        """With segments (document masking), rotary positions restart per document and the indexer,
        its top-k and the dense paths see only the query's own document. Under context parallelism
        (segments.context) the queries are this rank's slice of the keys up to its end: the indexer scores
        all of those keys (gathered) and picks what one process would; the sparse stage then fetches only the
        selected keys and values from the earlier ranks (model/ops/sparse_attention/context_parallel.py), the dense paths
        gather them all."""
        B, T, _ = x.shape
        offset = cache["offset"] if cache is not None else 0
        context = None if segments is None else segments.context
        positions = continued_positions(cache, segments, T, x.device)
        seg = None if segments is None else segments.segment_ids  # the keys' documents [B, S]
        q, k, v = project_qkv(self, x, offset, positions)  # [B, T, H(kv), D]
        q_i, k_i, w = self.indexer(x.detach(), offset, positions)
        first_key = None
        if cache is not None:
            if "k" not in cache:
                cache.update(k=KVBuffer(dim=1), v=KVBuffer(dim=1), index_k=KVBuffer(dim=1))
            k, v, k_i = cache["k"].append(k), cache["v"].append(v), cache["index_k"].append(k_i)
            if segments is None and "start" in cache:  # a cache's later calls: the keys of each row's last segment
                first_key = cache["start"]
                keys = torch.arange(k.shape[1], device=x.device)
                seg = torch.where(keys >= first_key[:, None], first_key[:, None], -1)
        length = k.shape[1]  # the keys of the whole sequence (under context parallelism: the whole rows')
        if context is not None:
            offset, length, own = segments.start, segments.length, (k, v)
            k_i = context.gather_sequence(k_i, segments.end)
        sparse = self.stage == "sparse" and length > self.topk
        report = aux is not None and cache is None  # no indexer loss or metrics while decoding
        indices = None
        if sparse or (report and not self.training):
            indices = index_topk(q_i, k_i, w, self.topk, offset, seg)  # [B, T, K], -1 = empty slot
        if sparse:
            selected = indices
            if context is not None:  # a compact table: the selected keys of earlier ranks, then this rank's
                D = k.shape[-1]
                table, selected, table_keys = fetch_selected(indices, torch.cat([k, v], -1), context, offset, length)
                k, v = table[..., :D], table[..., D:]
                k_i = k_i.gather(1, table_keys[..., None].expand(-1, -1, k_i.shape[-1]))
            selection = Selection(selected, k.shape[1])  # shared by the attention and the indexer loss
            o, p = selected_attention(q, k, v, selection, with_probs=report)  # p: the indexer's target
        else:
            if context is not None:
                k, v = (context.gather_sequence(t, segments.end) for t in (k, v))
            o = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), segments, first_key).transpose(1, 2)
        if report:
            if sparse:
                logits = index_scores_at(q_i, k_i, w, selection)
            else:
                p = dense_attention_probs(q, k, offset, segment_ids=seg)
                logits = index_scores(q_i, k_i, w, offset, segment_ids=seg)
            # L_I = mean_t KL(p_t || softmax(I_t)) over the selected keys (all causal keys in warm-up)
            real = None if segments is None else segments.real  # a padded batch: its pads' queries left out
            aux.add_loss("dsa/indexer_kl", indexer_kl(p, logits, aux, real), self.indexer_loss_coef)
            if not self.training:
                every_key = k if context is None or not sparse else context.gather_sequence(own[0], segments.end)
                self.report_recall(aux, q, every_key, indices, offset, seg, real)
        return self.o_proj(o.reshape(B, T, -1))

    def report_recall(self, aux, q, k, indices, offset: int = 0, segment_ids=None, real=None) -> None:
        """sum over the selected keys of the dense head-averaged attention probability, mean over (real) queries."""
        p = dense_attention_probs(q, k, offset, segment_ids=segment_ids).gather(-1, indices.clamp(min=0))
        recall = (p * (indices >= 0)).sum(-1)
        aux.add_metric("dsa/topk_attention_recall", aux.sequence_mean(recall.flatten() if real is None else recall[real]))

    def flops_per_token(self, seq_len: int, device) -> float:
        """Projections, attention over min(topk, t) keys at position t (all t keys in warm-up), and the indexer
        (LightningIndexer.flops_per_token, its own part: warm-up trains it alone)."""
        k = self.topk if self.stage == "sparse" else seq_len
        if seq_len <= k:
            keys = (seq_len + 1) / 2
        else:  # sum_{t=1..L} min(k, t) / L
            keys = (k * (k + 1) / 2 + (seq_len - k) * k) / seq_len
        attention = attention_projection_flops(self) + 2 * 2 * self.num_heads * self.head_dim * keys
        return attention + self.indexer.flops_per_token(seq_len, device)
