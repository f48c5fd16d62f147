"""Mixture-of-Experts FFN: fine-grained routed SwiGLU experts plus optional shared experts.

    s_t = softmax(x_t W_r^T)  or  sigmoid(x_t W_r^T)              router scores, fp32 (at least)
    K_t = topk_i(s_{t,i} + b_i)                                   b: aux-free bias, selection only
    g_{t,i} = route_scale * s_{t,i} [/ sum_{j in K_t} s_{t,j}]    renormalised if norm_topk_prob
    y_t = Shared(x_t) + sum_{i in K_t} g_{t,i} E_i(x_t),  E_i(x) = (silu(x W_g,i) * x W_u,i) W_d,i

Each routed expert is computed only on the tokens that selected it: the (token, slot) assignments
are sorted by expert, the tokens gathered once into that order, each expert runs on its contiguous
slice, and the gate-weighted outputs are added back to their tokens. On CUDA, for bf16 experts with
16-byte rows (`grouped_mm_takes`), the slices go through torch._grouped_mm (a fused kernel on sm90+,
torch's per-group loop otherwise); otherwise, and on CPU,
through a loop over the experts that received tokens, one autograd node with a hand-written
backward. With k = 1 and norm_topk_prob the gate is always 1, so the router then learns only from
the balance loss.

Balancing (each switchable):
- Switch balance loss  L_bal = E sum_i f_i P_i, f_i = share of the N k assignments routed to i,
  P_i = mean_t p_{t,i} (p = s, normalised to sum 1 per token for sigmoid scores). A perfectly
  balanced router gives 1. transformers' load_balancing_loss_func uses f_i = share of the N tokens
  routed to i (summing to k), so its value is k times ours.
- Router z-loss (ST-MoE)  L_z = mean_t (logsumexp_i logits_{t,i})^2.
- Auxiliary-loss-free balancing (DeepSeek-V3): per-expert selection counts are accumulated over the
  training forwards of one optimizer step; after_optimizer_step() sums them over ranks and sets
  b_i += gamma sign(mean_j load_j - load_i), then b -= mean(b).
- capacity_factor C: each expert keeps at most ceil(C N k / E) assignments per forward, earliest
  tokens first; the rest are dropped (the token keeps its residual and shared path) and counted.

Init as DeepSeek-V3 / Qwen2-MoE (transformers' _init_weights of both): router weight and both expert
weights N(0, initializer_range), the aux-free bias 0; the shared experts are a SwiGLU (Llama's MLP,
as Qwen2-MoE's shared_expert), which initialises itself. Ours differs on purpose in one place, shared
by every block: the experts' down projection, which writes into the residual stream, gets
std * 1/sqrt(2 L) (model/layers.py residual_scale).
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from transformers import initialization as init

from model.ffn.dense import SwiGLU
from model.layers import residual_scale
from model.options import bad_option, option
from model.registry import FFNS

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class MoEOptions:
    num_experts: int = option(8, at_least=1)                     # E
    top_k: int = option(2, at_least=1)                           # k <= E
    # None: intermediate_size // (top_k + num_shared_experts), the active width of the dense FFN
    expert_intermediate_size: int | None = option(None, at_least=1)
    num_shared_experts: int = option(0, at_least=0)
    score_func: str = option("softmax", choices=SCORE_FUNCS)
    norm_topk_prob: bool = option(True)                          # renormalise the selected gates to sum 1
    route_scale: float = option(1.0)
    balance_loss_coef: float = option(1e-2, at_least=0)          # Switch balance loss (1.0 when balanced); 0 logs only
    z_loss_coef: float = option(1e-3, at_least=0)                # router z-loss; 0 logs only
    aux_free_bias: bool = option(False)                          # DeepSeek-V3 bias balancing, after each optimizer step
    bias_update_rate: float = option(1e-3, at_least=0)           # gamma
    capacity_factor: float | None = option(None, above=0)        # None: dropless; C: ceil(C N k / E) per expert


@FFNS.register("moe")
class MoE(nn.Module):
    may_leave_parameters_unused = True  # an expert that gets no token in a micro-batch gets no gradient
    Options = MoEOptions

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        opts = config.options_for_ffn("moe", MoEOptions)
        if opts.top_k > opts.num_experts:
            raise bad_option("moe", "top_k", opts.top_k, f"1..num_experts={opts.num_experts}")
        self.layer_idx = layer_idx
        self.num_experts, self.top_k = opts.num_experts, opts.top_k
        self.num_shared = opts.num_shared_experts
        self.score_func = opts.score_func
        self.norm_topk_prob = opts.norm_topk_prob
        self.route_scale = opts.route_scale
        self.balance_loss_coef, self.z_loss_coef = opts.balance_loss_coef, opts.z_loss_coef
        self.aux_free_bias, self.bias_update_rate = opts.aux_free_bias, opts.bias_update_rate
        self.capacity_factor = opts.capacity_factor
        d, E = config.hidden_size, self.num_experts
        f = opts.expert_intermediate_size or config.intermediate_size // (self.top_k + self.num_shared)
        self.hidden_size, self.expert_size = d, f
        self.init_std, self.residual_scale = config.initializer_range, residual_scale(config)

        self.router = nn.Linear(d, E, bias=False)
        # Stacked expert weights, laid out for x @ W: gate and up fused into one [d, 2f] matrix.
        self.gate_up_proj = nn.Parameter(torch.empty(E, d, 2 * f))
        self.down_proj = nn.Parameter(torch.empty(E, f, d))
        self.shared = SwiGLU(config, layer_idx, intermediate_size=self.num_shared * f) if self.num_shared else None
        if self.aux_free_bias:
            self.register_buffer("expert_bias", torch.zeros(E), persistent=True)
        # Selection counts since the last optimizer step (aux-free balancing). A plain attribute, not
        # a buffer: DDP would overwrite it with rank 0's counts at every forward.
        self.pending_counts: torch.Tensor | None = None

    def init_parameters(self) -> None:
        init.normal_(self.router.weight, mean=0.0, std=self.init_std)
        init.normal_(self.gate_up_proj, mean=0.0, std=self.init_std)
        init.normal_(self.down_proj, mean=0.0, std=self.init_std * self.residual_scale)
        if self.aux_free_bias:
            init.zeros_(self.expert_bias)

    # routing -----------------------------------------------------------------------------------
    def route(self, x: torch.Tensor):
        """x [N, d] -> router logits [N, E] (fp32 or wider), scores [N, E], top-k experts [N, k], gates [N, k]."""
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 at least, float64 stays float64
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.to(dtype), self.router.weight.to(dtype))
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores.detach()
        if self.aux_free_bias:
            choice = choice + self.expert_bias.to(dtype)
        experts = choice.topk(self.top_k, dim=-1).indices
        gates = scores.gather(-1, experts)
        if self.norm_topk_prob:
            gates = gates / gates.sum(-1, keepdim=True)
        return logits, scores, experts, gates * self.route_scale

    # forward -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, aux=None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N, k, E = x.shape[0], self.top_k, self.num_experts
        logits, scores, experts, gates = self.route(x)

        # Sort the N k (token, slot) assignments by expert; stable, so tokens keep their order.
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        routed = torch.bincount(flat, minlength=E)
        counts = routed
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * N * k / E)
            rank = torch.arange(N * k, device=x.device) - (routed.cumsum(0) - routed)[flat[order]]
            order = order[rank < capacity]
            counts = routed.clamp(max=capacity)
        token = order // k
        xs = x.index_select(0, token)
        # Experts run in the autocast dtype when autocast is on (as nn.Linear would), else in x's.
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        xs, w_gu, w_d = xs.to(dtype), self.gate_up_proj.to(dtype), self.down_proj.to(dtype)
        if x.is_cuda and grouped_mm_takes(dtype, self.hidden_size, self.expert_size):
            ys = experts_grouped_mm(xs, w_gu, w_d, counts)
        else:
            ys = ExpertsLoop.apply(xs, w_gu, w_d, counts.tolist())
        ys = ys * gates.flatten()[order].unsqueeze(-1).to(ys.dtype)
        y = ys.new_zeros(x.shape).index_add(0, token, ys)
        if self.shared is not None:
            y = y + self.shared(x)

        if self.training and self.aux_free_bias:
            c = routed.detach().float()
            self.pending_counts = c if self.pending_counts is None else self.pending_counts + c
        if aux is not None:
            self.report(aux, logits, scores, routed, 1 - order.numel() / (N * k))
        return y.view(shape)

    def report(self, aux, logits, scores, routed, dropped_frac: float) -> None:
        """Aux losses (always) and load telemetry (training only) for this layer."""
        E, tag = self.num_experts, f"moe/layer{self.layer_idx}"
        probs = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        frac = routed.to(probs.dtype) / routed.sum()  # f_i, share of assignments routed to expert i
        balance = E * (frac * probs.mean(0)).sum()
        z = torch.logsumexp(logits, dim=-1).square().mean()
        aux.add_loss("moe/balance_loss", balance, self.balance_loss_coef)
        aux.add_loss("moe/z_loss", z, self.z_loss_coef)
        if not self.training:
            return
        with torch.no_grad():
            metrics = {
                "balance_loss": balance.detach(),
                "z_loss": z.detach(),
                "imbalance": frac.max() * E,  # max load / mean load
                "load_cv": frac.std(correction=0) * E,  # std / mean
                "dead_experts": (routed == 0).sum().float(),
                "router_entropy": -(probs * probs.clamp_min(1e-20).log()).sum(-1).mean(),  # nats
                "dropped_frac": torch.tensor(dropped_frac, device=routed.device),
            }
            for name, value in metrics.items():
                if name not in ("balance_loss", "z_loss"):
                    aux.add_metric(f"moe/{name}", value)
                aux.add_metric(f"{tag}/{name}", value)
            aux.add_metric(f"{tag}/load", frac)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Aux-free balancing: b_i += gamma sign(mean load - load_i), mean-centred, loads summed over
        ranks; then the counts restart."""
        if not self.aux_free_bias or self.pending_counts is None:
            return
        load = self.pending_counts
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(load)
        bias = self.expert_bias.float() + self.bias_update_rate * torch.sign(load.mean() - load)
        self.expert_bias.copy_(bias - bias.mean())
        self.pending_counts = None

    # accounting --------------------------------------------------------------------------------
    def flops_per_token(self) -> int:
        """Router + k routed experts + shared experts (forward, 2 FLOPs per multiply-add)."""
        d, f = self.hidden_size, self.expert_size
        return 2 * d * self.num_experts + 2 * 3 * d * f * (self.top_k + self.num_shared)

    def inactive_parameters(self) -> int:
        """Routed-expert parameters a token does not use: (E - k) experts."""
        return (self.num_experts - self.top_k) * 3 * self.hidden_size * self.expert_size


def grouped_mm_takes(dtype: torch.dtype, d: int, f: int) -> bool:
    """Whether torch._grouped_mm takes the experts' operands (the checks of its meta function, which
    torch.compile runs; the eager kernel fails on misaligned rows too): bf16 only, and every operand's
    rows a multiple of 16 bytes, xs [S, d], W_gu [E, d, 2f], silu(gate) up [S, f], W_d [E, f, d]: both d and f."""
    return dtype == torch.bfloat16 and d % 8 == 0 and f % 8 == 0  # 8 bf16 = 16 bytes


def experts_grouped_mm(xs: torch.Tensor, w_gu: torch.Tensor, w_d: torch.Tensor, counts: torch.Tensor):
    """All experts in two grouped matmuls; rows of xs [S, d] are grouped by expert, counts [E]."""
    offs = counts.cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(xs, w_gu, offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w_d, offs=offs)


class ExpertsLoop(torch.autograd.Function):
    """ys[rows of e] = (silu(xs W_g,e) * xs W_u,e) W_d,e for each expert e over its contiguous rows.

    One autograd node for all experts, every product written in place into preallocated buffers
    (per-expert autograd would build ~10 nodes per expert and a zero-filled [E, ...] gradient for
    each weight slice)."""

    @staticmethod
    def forward(ctx, xs, w_gu, w_d, counts: list[int]):
        S, f = xs.shape[0], w_d.shape[1]
        h = xs.new_empty(S, 2 * f)  # [x W_g | x W_u]
        act = xs.new_empty(S, f)
        ys = xs.new_empty(S, xs.shape[1])
        start = 0
        for e, n in enumerate(counts):
            rows = slice(start, start + n)
            start += n
            if n == 0:
                continue
            torch.mm(xs[rows], w_gu[e], out=h[rows])
            torch.mul(F.silu(h[rows, :f]), h[rows, f:], out=act[rows])
            torch.mm(act[rows], w_d[e], out=ys[rows])
        ctx.save_for_backward(xs, w_gu, w_d, h, act)
        ctx.counts = counts
        return ys

    @staticmethod
    def backward(ctx, grad_ys):
        xs, w_gu, w_d, h, act = ctx.saved_tensors
        f = w_d.shape[1]
        grad_ys = grad_ys.contiguous()
        grad_xs, grad_gu, grad_d = torch.empty_like(xs), torch.empty_like(w_gu), torch.empty_like(w_d)
        grad_act = torch.empty_like(act)
        grad_h = torch.empty_like(h)
        start = 0
        for e, n in enumerate(ctx.counts):
            rows = slice(start, start + n)
            start += n
            if n == 0:
                grad_gu[e].zero_()
                grad_d[e].zero_()
                continue
            gate, up = h[rows, :f], h[rows, f:]
            torch.mm(act[rows].t(), grad_ys[rows], out=grad_d[e])
            torch.mm(grad_ys[rows], w_d[e].t(), out=grad_act[rows])
            # d act / d up = silu(gate); d act / d gate = up * silu'(gate)
            torch.mul(grad_act[rows], F.silu(gate), out=grad_h[rows, f:])
            grad_h[rows, :f] = torch.ops.aten.silu_backward(grad_act[rows] * up, gate)
            torch.mm(grad_h[rows], w_gu[e].t(), out=grad_xs[rows])
            torch.mm(xs[rows].t(), grad_h[rows], out=grad_gu[e])
        return grad_xs, grad_gu, grad_d, None
