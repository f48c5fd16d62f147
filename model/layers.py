"""Pieces shared by several blocks: norms, rotary embedding, the causal short convolution,
the initialisers the blocks share and the aux-loss channel (a packed batch's document segments:
model/segments.py).

Init: each block (mixer, FFN, norm) defines `init_parameters()`, which initialises its own parameters
and those of its submodules that define no `init_parameters()` of their own, as the block's reference
does. `DecoderLM._init_weights` calls it and itself initialises only the embeddings and an untied
lm_head. It must use `transformers.initialization` (which skips tensors that `from_pretrained`
loaded, flagged `_is_hf_initialized`), never in-place arithmetic on a parameter.
"""
import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import initialization as init

from model.ops.kernels import accumulation_dtype
from model.segments import DocumentSegments


def eval_variant_names(model: nn.Module) -> list[str]:
    """The evaluation variants the model's blocks declare: a block whose evaluation forward can also run another way
    (a non-causal router's training routing) names it in `eval_variants` and switches with set_eval_variant(name or
    None); the val scorer scores each variant a second time, under val/<name>/ (evaluation/scoring.py)."""
    return sorted({name for m in model.modules() for name in getattr(m, "eval_variants", ())})


@contextmanager
def eval_variant(model: nn.Module, name: str):
    """Within: every block of the model that declares the evaluation variant `name` runs it."""
    blocks = [m for m in model.modules() if name in getattr(m, "eval_variants", ())]
    for block in blocks:
        block.set_eval_variant(name)
    try:
        yield
    finally:
        for block in blocks:
            block.set_eval_variant(None)


class AuxCollector:
    """The one channel through which blocks report extra losses and metrics during a forward.

    `add_loss(name, value, coef)`: coef * value is added to the training loss; the unscaled value is
    logged under `name`. `add_metric(name, value)`: logged only (a detached scalar or a vector).
    Values under one name from several layers are averaged for logging; per-layer copies may be
    reported under their own names too. `on_token_loss(consume, with_eval_loss)`: a block whose loss needs
    each token's LM loss (the REINFORCE router) subscribes `consume(aux, token_loss [N], labelled [N],
    eval_loss [N] | None)`, eval_loss the same tokens' loss under the model's evaluation forward if any
    subscriber asked (with_eval_loss); the model calls `give_token_loss` once its LM loss is known,
    before `total_loss`.

    Under context parallelism (`context`, the forward's ContextGroup) a block holds a slice of every sequence;
    a loss or metric over the tokens of a forward is taken over the whole sequences through `over_sequence`
    (a sum) and `sequence_mean`, so that every rank reports what one process would.
    """

    def __init__(self, context=None):
        self.context = context
        self.losses: dict[str, list[tuple[torch.Tensor, float]]] = {}
        self.metrics: dict[str, list[torch.Tensor]] = {}
        self.token_loss_consumers: list = []
        self.wants_eval_loss = False

    def over_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """x, a sum over this forward's tokens, summed over the other slices of its sequences (context parallelism;
        differentiable); x itself otherwise."""
        return x if self.context is None else self.context.total(x)

    def sequence_mean(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """x's mean over its token dim `dim`, over the whole sequences under context parallelism (every slice holds
        as many tokens); x.mean(dim) otherwise."""
        if self.context is None:
            return x.mean(dim)
        return self.context.total(x.sum(dim)) / (x.shape[dim] * self.context.size)

    def on_token_loss(self, consume, with_eval_loss: bool = False) -> None:
        self.token_loss_consumers.append(consume)
        self.wants_eval_loss |= with_eval_loss

    def give_token_loss(self, token_loss, labelled: torch.Tensor, eval_token_loss=None) -> None:
        """token_loss(): each token's loss [N], computed only if some block subscribed; labelled [N] bool:
        the tokens that have a label (the loss of the others is not used); eval_token_loss(): each token's
        loss [N] under the evaluation forward (no grad), computed only if some subscriber asked for it."""
        if not self.token_loss_consumers:
            return
        if self.wants_eval_loss and eval_token_loss is None:
            raise ValueError("a block needs each token's loss under the evaluation forward, and this forward gives none")
        loss = token_loss().detach()
        eval_loss = eval_token_loss().detach() if self.wants_eval_loss else None
        for consume in self.token_loss_consumers:
            consume(self, loss, labelled, eval_loss)

    def add_loss(self, name: str, value: torch.Tensor, coef: float) -> None:
        self.losses.setdefault(name, []).append((value, coef))

    def add_metric(self, name: str, value: torch.Tensor) -> None:
        self.metrics.setdefault(name, []).append(value.detach())

    def total_loss(self) -> torch.Tensor | None:
        terms = [coef * value for items in self.losses.values() for value, coef in items if coef]
        return torch.stack(terms).sum() if terms else None

    def summary(self) -> dict[str, torch.Tensor]:
        """Mean over layers of every loss (unscaled) and metric."""
        out = {}
        for name, items in self.losses.items():
            out[name] = torch.stack([v.detach().float() for v, _ in items]).mean(0)
        for name, items in self.metrics.items():
            out[name] = torch.stack([v.float() for v in items]).mean(0)
        return out


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 (half inputs) or its own dtype (fp32, fp64): where norms and gates compute."""
    return x.to(accumulation_dtype(x.dtype))


class KVBuffer:
    """A decode cache's growing tensor (keys, values, index keys): appends along `dim` into storage reserved
    BLOCK positions at a time (always past the filled part), the filled part handed out as a view. A decoded
    token copies only itself; the whole context is copied once per BLOCK tokens, where torch.cat would copy it
    every token."""

    BLOCK = 256

    def __init__(self, dim: int):
        self.dim, self.storage, self.length = dim, None, 0

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Writes x (detached: a cache carries no gradient) after the filled part; returns the new filled part."""
        needed = self.length + x.shape[self.dim]
        if self.storage is None or needed > self.storage.shape[self.dim]:
            shape = list(x.shape)
            shape[self.dim] = (needed // self.BLOCK + 1) * self.BLOCK  # room for the next token, even right after a prefill
            storage = x.new_empty(shape)
            if self.storage is not None:
                storage.narrow(self.dim, 0, self.length).copy_(self.filled())
            self.storage = storage
        self.storage.narrow(self.dim, self.length, x.shape[self.dim]).copy_(x.detach())
        self.length = needed
        return self.filled()

    def filled(self) -> torch.Tensor:
        return self.storage.narrow(self.dim, 0, self.length)

    def reorder(self, rows: torch.Tensor) -> None:
        """Keeps the batch rows `rows` (beam search's reorder, or a row repeated)."""
        self.storage = self.storage.index_select(0, rows.to(self.storage.device))

    def nbytes(self) -> int:
        """Bytes of the filled part (the reserved tail, under BLOCK positions, is not counted)."""
        return self.filled().numel() * self.storage.element_size()


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 (fp64 for fp64 inputs)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = at_least_fp32(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def init_parameters(self) -> None:
        init.ones_(self.weight)


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x) * act(gate) (norm before gate, GDN, KDA) or RMSNorm(x * act(gate)) (norm after
    gate, Mamba2), over the last dim, which is one head or one group; act is silu (GDN, Mamba2) or
    sigmoid (KDA)."""

    ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}

    def __init__(self, dim: int, eps: float = 1e-6, norm_before_gate: bool = True, activation: str = "silu"):
        super().__init__(dim, eps)
        self.norm_before_gate = norm_before_gate
        self.activation = self.ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.norm_before_gate:
            return super().forward(x) * self.activation(at_least_fp32(gate)).to(x.dtype)
        return super().forward((at_least_fp32(x) * self.activation(at_least_fp32(gate))).to(x.dtype))


class RotaryEmbedding:
    """RoPE (half-split convention): x -> x cos(p w) + rotate_half(x) sin(p w), w_i = theta^(-2i/d),
    applied to the first `dim` channels of each head (partial rotary when dim < head_dim)."""

    def __init__(self, dim: int, theta: float = 10000.0):
        self.dim = dim
        self.theta = theta

    def cos_sin(self, offset: int, length: int, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, dim] at positions offset..offset+length-1."""
        return self.cos_sin_at(torch.arange(offset, offset + length, device=device), dtype)

    def cos_sin_at(self, positions: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., dim] at integer positions [...] (e.g. [B, T] position_ids), angles in dtype."""
        # Computed per call (no buffer): cheap, and nothing for from_pretrained to leave uninitialised.
        inv_freq = self.theta ** (-torch.arange(0, self.dim, 2, device=positions.device, dtype=dtype) / self.dim)
        freqs = positions.to(dtype)[..., None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, H, D] with D >= dim; cos, sin [T, dim] or [B, T, dim]."""
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        cos, sin = cos[..., None, :].to(x.dtype), sin[..., None, :].to(x.dtype)
        half = self.dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot * cos + rotated * sin
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


class ShortConv(nn.Module):
    """Depthwise causal 1-D convolution over time + SiLU (the short conv of Mamba2 / GDN).

    forward(x [B, T, C], cache, key, segments) -> y [B, T, C]. With a cache dict, the last (kernel - 1)
    inputs are kept under `key` so decoding continues exactly where the previous call stopped. With
    DocumentSegments, the taps that reach across a segment start are subtracted (only the first
    kernel - 1 tokens of each segment have any). Under context parallelism (segments.context) the first
    kernel - 1 tokens read the previous rank's last kernel - 1 inputs (its halo, ContextGroup.shift), as
    they would read them in one process.
    """

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = False):
        super().__init__()
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=bias,
                              padding=0)

    def forward(self, x: torch.Tensor, cache: dict | None = None, key: str = "conv",
                segments: DocumentSegments | None = None) -> torch.Tensor:
        B, T, C = x.shape
        W = self.kernel_size
        past = cache.get(key) if cache is not None else None
        if segments is not None and segments.context is not None and W > 1:
            past = segments.context.shift(x[:, T - (W - 1):]).transpose(1, 2)  # [B, C, W - 1]
        if past is None:
            past = x.new_zeros(B, C, W - 1)
        xp = torch.cat([past.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, W - 1 + T]
        if cache is not None:  # the last W - 1 inputs; with segments only those of the row's last segment
            tail = xp[..., -(W - 1):].detach()
            if segments is not None and W > 1:
                t = torch.arange(T - (W - 1), T, device=x.device)
                tail = tail * (t >= segments.last_start[:, None])[:, None].to(tail.dtype)
            cache[key] = tail
        y = F.conv1d(xp, self.conv.weight, self.conv.bias, groups=C).transpose(1, 2)
        if segments is not None and W > 1:  # y_t = b + sum_lag w[W - 1 - lag] x_{t - lag}: drop lags before the segment
            b, t, lag = segments.conv_crossings(W)
            leak = xp[b, :, t - lag + W - 1] * self.conv.weight[:, 0, :].T[W - 1 - lag]  # fp32 under autocast (the weight's)
            y = y.index_put((b, t), -leak.to(y.dtype), accumulate=True)  # in y's dtype: CUDA autocast would promote y
        return F.silu(y)


def residual_scale(config) -> float:
    """The init scale of every projection that writes into the residual stream (two per layer): 1 / sqrt(2 L)
    where the parametrization rescales (model/config.py), so that the stream's variance at init does not grow
    with depth (GPT-2, Megatron; mamba_ssm's rescale_prenorm_residual, fla's prenorm_residual_strategy="rescale");
    else 1 (Llama)."""
    return 1 / math.sqrt(2 * config.num_hidden_layers) if config.parametrization_rule().rescale_residual else 1.0


def ffn_residual_scale(config) -> float:
    """An FFN's residual_scale, or 0 where the parametrization starts every FFN's write at zero (model/config.py)."""
    return 0.0 if config.parametrization_rule().ffn_starts_at_zero else residual_scale(config)


def init_fan_in_uniform_(tensor: torch.Tensor, fan_in: int, scale: float = 1.0) -> None:
    """U(-b, b), b = scale / sqrt(fan_in): PyTorch's default for nn.Linear / nn.Conv1d weights
    (kaiming_uniform_ with a = sqrt(5)) and biases, times scale."""
    bound = scale / math.sqrt(fan_in)
    init.uniform_(tensor, -bound, bound)


def init_dt_bias_(dt_bias: torch.Tensor, dt_min: float = 1e-3, dt_max: float = 1e-1,
                  dt_floor: float = 1e-4) -> None:
    """dt ~ exp(U(log dt_min, log dt_max)) clamped >= dt_floor; store softplus^-1(dt) = dt + log(-expm1(-dt))
    so that softplus(dt_bias) = dt at init (Mamba2 / GDN)."""
    dt = torch.exp(torch.rand(dt_bias.shape) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=dt_floor)
    init.copy_(dt_bias, dt + torch.log(-torch.expm1(-dt)))


def init_A_log_(A_log: torch.Tensor, low: float, high: float) -> None:
    """A ~ U(low, high), stored as log A (the decay is -exp(A_log))."""
    init.copy_(A_log, torch.empty(A_log.shape).uniform_(low, high).log())
