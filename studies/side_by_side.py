"""The harness of the studies that train ours beside other libraries' models in one process, on identical batches
(studies/mqar.py, studies/gdn_language.py, studies/state_tracking.py), which train.py cannot do: ours and the
reference built to one Shape, the one training loop, and each side's best lr. analysis/runner.py's run_pending runs
their jobs."""
import math
import sys
import time
from dataclasses import dataclass
from functools import partial

import torch

from analysis.best import best_value
from model import DecoderLM, LMConfig
from model.config import PER_MIXER


@dataclass(frozen=True)
class Shape:
    """What ours and its reference share: layers, heads, the longest sequence, the FFN width (None: LMConfig's)."""
    layers: int
    heads: int
    seq_len: int
    intermediate_size: int | None = None


def ours(mixer: str, vocab: int, d: int, parametrization: str, shape: Shape, options: dict | None = None):
    """DecoderLM of `shape` with `mixer` in every layer, with its mixer.options `options` (None: its defaults)."""
    return DecoderLM(LMConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=shape.layers,
                              num_attention_heads=shape.heads, max_position_embeddings=shape.seq_len,
                              intermediate_size=shape.intermediate_size, mixer=mixer, parametrization=parametrization,
                              mixer_options={mixer: options} if options else None))


def reference(name: str, vocab: int, d: int, shape: Shape, options: dict | None = None):
    """The reference model (transformers', or fla's for linear attention and Gated DeltaProduct) of the same shape
    as ours (heads, head and state widths, FFN width; ours with mixer.options `options`, which fla's Gated
    DeltaProduct takes too), at its own init (and untied embeddings where its config's default is)."""
    if name == "qwen3_next_gdn":  # its GDN ops bind to fla's Triton kernels at import when fla is there: take the torch ones
        sys.modules["fla"] = None
    from transformers import (LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM, Qwen3NextConfig,
                              Qwen3NextForCausalLM)

    mine = ours({"llama": "softmax", "qwen3_next_gdn": "gdn", "mamba2": "mamba2", "fla_linear_attn": "linear",
                 "fla_gated_deltaproduct": "deltaproduct"}[name], vocab, d, PER_MIXER, shape, options)
    common = dict(vocab_size=vocab, hidden_size=d, num_hidden_layers=shape.layers, pad_token_id=0, bos_token_id=0,
                  eos_token_id=0, use_cache=False)
    if name == "fla_linear_attn":
        return fla_linear_attention(common, mine.config.intermediate_size, shape)
    if name == "fla_gated_deltaproduct":
        return fla_gated_deltaproduct(common, mine, shape)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
                                            intermediate_size=mine.config.intermediate_size,
                                            max_position_embeddings=shape.seq_len))
    if name == "qwen3_next_gdn":
        gdn = mine.layers[0].mixer
        return Qwen3NextForCausalLM(Qwen3NextConfig(
            **common, layer_types=["linear_attention"] * shape.layers, num_experts=0,
            intermediate_size=mine.config.intermediate_size, num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
            linear_num_key_heads=gdn.num_heads, linear_key_head_dim=gdn.head_dim, linear_num_value_heads=gdn.num_v_heads,
            linear_value_head_dim=gdn.head_v_dim, linear_conv_kernel_dim=gdn.conv_size, max_position_embeddings=shape.seq_len))
    m = mine.layers[0].mixer
    return Mamba2ForCausalLM(Mamba2Config(**common, expand=m.d_inner // d, head_dim=m.head_dim, num_heads=m.num_heads,
                                          state_size=m.state_size, n_groups=m.n_groups, conv_kernel=m.conv.kernel_size,
                                          chunk_size=m.chunk_size, tie_word_embeddings=True))


def fla_linear_attention(common: dict, intermediate_size: int, shape: Shape):
    """fla's LinearAttentionForCausalLM at its defaults (a learned Hadamard feature map, no normaliser, a per-head
    output RMSNorm, no rotary, fla's init), with torch's norms and loss where its config offers fused ones, and
    its Triton calls, which raise on a CPU, replaced by the same math: fla's own reference recurrence
    (fla/ops/linear_attn/naive.py) for its linear-attention kernels, nn.RMSNorm (weight at 1, as fla's) for the
    attention's output norm, silu(gate) * up for the MLP's swiglu."""
    import fla.layers.linear_attn as fla_layer
    from fla.models import LinearAttentionConfig, LinearAttentionForCausalLM
    from fla.ops.linear_attn.naive import naive_recurrent_linear_attn

    def linear_attn(q, k, v, initial_state=None, output_final_state=False, normalize=False, cu_seqlens=None):
        assert cu_seqlens is None, "one sequence per row"
        return naive_recurrent_linear_attn(q, k, v, initial_state=initial_state,
                                           output_final_state=output_final_state, normalize=normalize)

    # patched in fla's modules, so for this whole process: each run has its own (run_pending, maxtasksperchild=1).
    # The layer's three modes: chunk when training, fused_recurrent for a no-grad T <= 64, else fused_chunk.
    fla_layer.chunk_linear_attn = fla_layer.fused_chunk_linear_attn = fla_layer.fused_recurrent_linear_attn = linear_attn
    torch_for_fla_modules()
    model = LinearAttentionForCausalLM(LinearAttentionConfig(
        **common, attn_mode="chunk", num_heads=shape.heads, intermediate_size=intermediate_size,
        max_position_embeddings=shape.seq_len, fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False))
    for block in model.model.layers:
        fused = block.attn.norm
        block.attn.norm = torch.nn.RMSNorm(fused.hidden_size, eps=fused.eps)
    return model


def torch_for_fla_modules() -> None:
    """fla's modules that call Triton, which raises on a CPU, made the same math in torch for this whole process: the
    MLP's swiglu (silu(gate) * up), ShortConvolution (a causal depthwise conv, then its silu; one whole sequence per
    row, no cache), FusedRMSNormGated (RMSNorm(x) * weight * act(g), fla's norm before its gate) and RMSNorm (its
    ungated form, Gated DeltaProduct's without an output gate)."""
    import fla.modules.mlp as fla_mlp
    import torch.nn.functional as F
    from fla.modules import FusedRMSNormGated, RMSNorm, ShortConvolution

    def short_conv(self, x, residual=None, mask=None, cache=None, output_final_state=False, cu_seqlens=None, **kwargs):
        assert residual is None and mask is None and cache is None and cu_seqlens is None, "one sequence per row"
        y = F.conv1d(x.transpose(1, 2), self.weight, self.bias, padding=self.kernel_size[0] - 1, groups=self.groups)
        y = y[..., :x.shape[1]].transpose(1, 2)
        return (F.silu(y) if self.activation else y), None

    def norm_gated(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
        assert residual is None and not prenorm, "no fused residual"
        act = torch.sigmoid if self.activation == "sigmoid" else F.silu
        return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps) * act(g)

    def norm(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        assert residual is None and not prenorm, "no fused residual"
        return F.rms_norm(x.to(self.weight.dtype), (self.hidden_size,), self.weight, self.eps).to(x.dtype)

    fla_mlp.swiglu = lambda gate, up: F.silu(gate) * up
    ShortConvolution.forward, FusedRMSNormGated.forward, RMSNorm.forward = short_conv, norm_gated, norm


def fla_gated_deltaproduct(common: dict, mine, shape: Shape):
    """fla's GatedDeltaProductForCausalLM shaped as `mine` (our deltaproduct DecoderLM: heads, head width, expand_v,
    conv size, num_householder, allow_neg_eigval, FFN width), with its short convs, forget gate and output gate on or
    off as ours has them, fla's own init and untied embeddings, torch's norms and loss where its config offers fused ones, and its
    Triton calls replaced by the same math (torch_for_fla_modules; its chunked product by fla's own reference
    recurrence, fla/ops/gated_delta_product/naive.py, on q and k L2-normalised as its kernel does)."""
    import fla.layers.gated_deltaproduct as fla_layer
    from fla.models import GatedDeltaProductConfig, GatedDeltaProductForCausalLM
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product

    def product(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, num_householder=1,
                use_qk_l2norm_in_kernel=False, scale=None):
        assert cu_seqlens is None, "one sequence per row"
        if use_qk_l2norm_in_kernel:  # fla's l2norm: x / sqrt(sum x^2 + 1e-6)
            q, k = (x * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + 1e-6).to(x.dtype) for x in (q, k))
        return naive_recurrent_gated_delta_product(q, k, v, g, beta, q.shape[-1] ** -0.5 if scale is None else scale,
                                                   initial_state=initial_state, output_final_state=output_final_state,
                                                   num_householder=num_householder)

    # the layer trains in chunk mode; at eval fla takes its fused_recurrent kernel for T <= 64, which stays Triton's
    fla_layer.chunk_gated_delta_product = product
    torch_for_fla_modules()
    m = mine.layers[0].mixer
    return GatedDeltaProductForCausalLM(GatedDeltaProductConfig(
        **common, num_heads=m.num_heads, head_dim=m.head_dim, expand_v=m.expand_v, conv_size=m.conv_size,
        use_short_conv=m.q_conv is not None, use_forget_gate=m.a_proj is not None, use_output_gate=m.g_proj is not None,
        allow_neg_eigval=m.allow_neg_eigval, num_householder=m.steps,
        intermediate_size=mine.config.intermediate_size, max_position_embeddings=shape.seq_len, fuse_norm=False,
        fuse_swiglu=False, fuse_cross_entropy=False))


def warmup_cosine(s: int, warmup: int, steps: int) -> float:
    """The lr factor after s scheduler steps: (s + 1) / warmup for the warm-up, then cosine from 1 to 0.1 at `steps`
    (transformers' get_cosine_with_min_lr_schedule_with_warmup starts its warm-up at 0, s / warmup)."""
    return (s + 1) / warmup if s < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))


def train(model, parameters, batches, steps: int, lr: float, warmup: int, evaluate, eval_every: int) -> dict:
    """Trains model for `steps` steps with AdamW over `parameters` (betas 0.9, 0.95, weight decay 0.1 where a group
    sets none), warmup_cosine and clipping at 1, on the next-token loss of batches(step) = (input_ids, labels; -100
    not scored) for step 1..steps; evaluate(model) after every eval_every steps and the last one. Returns {evals:
    [(step, evaluate's result)], cpu_s, params}."""
    opt = torch.optim.AdamW(parameters, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, partial(warmup_cosine, warmup=warmup, steps=steps))
    evals, start = [], time.process_time()
    model.train()
    for step in range(1, steps + 1):
        input_ids, labels = batches(step)
        logits = model(input_ids=input_ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        if step % eval_every == 0 or step == steps:
            evals.append((step, evaluate(model)))
    return {"evals": evals, "cpu_s": round(time.process_time() - start, 1),
            "params": sum(p.numel() for p in model.parameters())}


def best_over_lr(runs: list[dict], score: str, higher_is_better: bool) -> dict | None:
    """The lr of the best mean final run[score] (analysis.best.best_value, on the seeds every lr ran): {lr, mean, lo,
    hi, seeds, curves, lrs, edge, beyond}, mean and min-max over every seed at that lr; edge and beyond as grid_edge
    gives them (the best at the low or high edge of the lrs tried, or the only one, and the lrs one step beyond
    it). None for no runs."""
    by_lr = {}
    for r in runs:
        by_lr.setdefault(r["lr"], []).append(r)
    best = best_value({lr: [(r["seed"], r[score]) for r in rs] for lr, rs in by_lr.items()}, higher_is_better)
    if best is None:
        return None
    values = [r[score] for r in by_lr[best.value]]
    return {"lr": best.value, "mean": sum(values) / len(values), "lo": min(values), "hi": max(values),
            "seeds": len(values), "curves": [r["curve"] for r in by_lr[best.value]], "lrs": sorted(by_lr),
            "edge": best.edge, "beyond": best.beyond}
