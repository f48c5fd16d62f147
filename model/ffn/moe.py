"""Mixture-of-Experts FFN: fine-grained routed SwiGLU experts plus optional shared experts.

    (t_s, e_s, g_s), s = 1..S = router(x, token ids)           the assignments: token t_s goes to expert e_s with gate g_s
    y_t = Shared(x_t) + sum_{s: t_s = t} g_s E_{e_s}(x_t),     E_i(x) = (silu(x W_g,i) * x W_u,i) W_d,i

The router is an option (`router`, one of model/ffn/routers/'s registry: topk (token choice, the
default), expert_choice, hash, balanced, reinforce), with its own options (`router_options`, its Options
dataclass); each router's file gives its formula, paper and what it does at evaluation and decoding. All
share what follows.

Each routed expert is computed only on the tokens assigned to it: the assignments are sorted by
expert, the tokens gathered once into that order, each expert runs on its contiguous slice, and the
gate-weighted outputs are added back to their tokens. On CUDA, for bf16 experts with 16-byte rows
(`grouped_mm_takes`), the slices go through torch._grouped_mm (a fused kernel on sm90+, torch's
per-group loop otherwise); otherwise, and on CPU, through a loop over the experts that received
tokens, one autograd node with a hand-written backward. With expert parallelism (shard_experts,
trainer.expert_parallel), each process holds E / N of the experts and the rows go to the process of
their expert and back by all-to-all (model/ffn/expert_parallel.py).

Balancing, per level (each loss always computed for the routers with scores and logged; its coef
weighs it into the training loss, 0 = log only). p = the router scores normalised to sum 1 per token;
f = shares of the router's assignments (before capacity), P = mean_t p:
- Switch balance loss (expert level, the forward's batch)  L_bal = E sum_i f_i P_i; 1 when balanced.
  transformers' load_balancing_loss_func uses f_i = share of the N tokens routed to i (summing to
  k), so its value is k times ours.
- Sequence-wise balance loss (DeepSeek-V3, arXiv:2412.19437 eq. 17-20): L_bal of each sequence (row
  of the batch) alone, averaged over the rows.
- Device-level balance loss (DeepSeek-V2, arXiv:2405.04434 eq. 14-16) over num_expert_groups groups
  of E / G contiguous experts (virtual now; the devices once experts are split across processes):
  L_dev = G sum_g f'_g P'_g, f'_g, P'_g the sums of f, P over group g; 1 when the groups are balanced.
- Group-limited routing (the router option max_groups_per_token, DeepSeek-V3 node-limited routing):
  token choice picks its experts from at most M groups (model/ffn/routers/routing.py).
- Router z-loss (ST-MoE)  L_z = mean_t (logsumexp_i logits_{t,i})^2; logged only for a router that
  declares takes_z_loss = False (reinforce by default: its logits are the policy's sharpness).
- Auxiliary-loss-free balancing (DeepSeek-V3; the routers that take a selection bias: topk, reinforce):
  per-expert selection counts are accumulated over the training forwards of one optimizer step;
  after_optimizer_step() sums them over ranks and sets b_i += gamma sign(mean_j load_j - load_i), then
  b -= mean(b); the router adds b to its scores for the top-k selection only.
- capacity_factor C (any router): each expert keeps at most ceil(C N k / E) assignments per forward,
  earliest tokens first; the rest are dropped (the token keeps its residual and shared path) and counted.

Telemetry (training forwards; names under moe/ are means over layers, moe/layer<i>/ per layer):
balance_loss, z_loss, sequence_balance_loss, group_balance_loss (G > 1), imbalance (max load / mean
load), load_cv, dead_experts, router_entropy, dropped_frac (assignments dropped by capacity),
unrouted_frac (tokens left with no expert), token_choice_overlap (expert_choice, balanced: how much of
evaluation's token choice the training routing also makes), group_imbalance (G > 1); per layer the
vectors load [E] and group_load [G].

Init as DeepSeek-V3 / Qwen2-MoE (transformers' _init_weights of both): both expert weights
N(0, initializer_range), the aux-free bias 0; the router (N(0, initializer_range) for those with
weights) and the shared experts, a SwiGLU (Llama's MLP, as Qwen2-MoE's shared_expert), initialise
themselves. Ours differs on purpose in one place, shared by every block: the experts' down
projection, which writes into the residual stream, gets std * 1/sqrt(2 L) (model/layers.py
residual_scale), or starts at 0 where the model's parametrization says so (model/config.py).
"""
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers import initialization as init

from model.ffn.dense import SwiGLU
from model.ffn.experts import ExpertsLoop, experts_grouped_mm, grouped_mm_takes
from model.ffn.routers import ROUTERS, Router, Routing
from model.layers import ffn_residual_scale
from model.options import bad_option, option, option_problems, parse_options
from model.registry import FFNS

LOSSES = ("balance_loss", "z_loss", "sequence_balance_loss", "group_balance_loss")  # logged by add_loss too


@dataclass
class MoEOptions:
    router: str = option("topk", choices=ROUTERS)
    # the router's own options (its Options dataclass), e.g. {"capacity_factor": 2.0} with router=expert_choice
    router_options: dict = dataclasses.field(default_factory=dict)
    num_experts: int = option(8, at_least=1)                     # E
    top_k: int = option(2, at_least=1)                           # k <= E
    # None: intermediate_size // (top_k + num_shared_experts), the active width of the dense FFN
    expert_intermediate_size: int | None = option(None, at_least=1)
    num_shared_experts: int = option(0, at_least=0)
    balance_loss_coef: float = option(1e-2, at_least=0)          # Switch balance loss (1.0 when balanced); 0 logs only
    sequence_balance_loss_coef: float = option(0.0, at_least=0)  # DeepSeek-V3 sequence-wise balance loss
    group_balance_loss_coef: float = option(0.0, at_least=0)     # DeepSeek-V2 device-level balance loss (G > 1)
    z_loss_coef: float = option(1e-3, at_least=0)                # router z-loss; 0 logs only
    aux_free_bias: bool = option(False)                          # DeepSeek-V3 bias balancing, after each optimizer step
    bias_update_rate: float = option(1e-3, at_least=0)           # gamma
    capacity_factor: float | None = option(None, above=0)        # None: dropless; C: ceil(C N k / E) per expert
    num_expert_groups: int = option(1, at_least=1)               # G groups of E / G contiguous experts (devices)

    def options_for_router(self, options_class):
        """The router's own options (an options_class) from router_options; a bad one is a one-line error."""
        return parse_options(f"{self.router} router", options_class, self.router_options)

    def part_problems(self) -> list[str]:
        """The problems of the router's options (model/options.py option_problems)."""
        return option_problems(f"{self.router} router", ROUTERS.get(self.router).Options, self.router_options)


def with_router_options_nested(given: dict | None) -> dict | None:
    """MoE options as saved before routers declared their own (a config.json of then): the router options sat flat
    beside the MoE's, prefixed by router where only one used them (reinforce_loss_coef, expert_choice_capacity_factor,
    balanced_sinkhorn_iterations; score_func, norm_topk_prob, route_scale, max_groups_per_token bare). The chosen
    router's move into router_options under their names; another router's were checked to hold their defaults
    then, and are dropped if they do; anything else stays, for parse_options to name."""
    if not given or "router_options" in given:
        return given
    given, nested = dict(given), {}
    chosen = given.get("router", MoEOptions.router)
    declared = {name: {f.name: f for f in dataclasses.fields(ROUTERS.get(name).Options)} for name in ROUTERS.names()}
    own = {f.name for f in dataclasses.fields(MoEOptions)}
    for key in [k for k in given if k not in own]:
        owners = [(name, key[len(name) + 1:]) for name in declared if key.startswith(f"{name}_")] or [
            (name, key) for name in declared]
        owners = [(name, field) for name, field in owners if field in declared[name]]
        mine = [field for name, field in owners if name == chosen]
        if mine:
            nested[mine[0]] = given.pop(key)
        elif owners and all(given[key] == declared[name][field].default for name, field in owners):
            given.pop(key)
    return {**given, "router_options": nested}


@FFNS.register("moe")
class MoE(nn.Module):
    may_leave_parameters_unused = True  # an expert that gets no token in a micro-batch gets no gradient
    Options = MoEOptions

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        opts = parse_options("moe", MoEOptions, with_router_options_nested(config.ffn_options.get("moe")))
        E, k, G = opts.num_experts, opts.top_k, opts.num_expert_groups
        if k > E:
            raise bad_option("moe", "top_k", k, f"1..num_experts={E}")
        if E % G:
            raise bad_option("moe", "num_expert_groups", G, f"a divisor of num_experts={E}")
        # Built here (a router with weights draws from the RNG as it is built), registered below.
        router = ROUTERS.get(opts.router)(config, layer_idx, opts)
        if opts.aux_free_bias and not router.takes_selection_bias:
            raise bad_option("moe", "aux_free_bias", True, f"False with router={opts.router}")
        self.layer_idx, self.router_name = layer_idx, opts.router
        self.num_experts, self.top_k, self.num_groups = E, k, G
        self.num_shared = opts.num_shared_experts
        self.balance_loss_coef = opts.balance_loss_coef
        self.z_loss_coef = opts.z_loss_coef if router.takes_z_loss else 0.0  # a router may keep its logits off it
        self.sequence_balance_loss_coef, self.group_balance_loss_coef = opts.sequence_balance_loss_coef, opts.group_balance_loss_coef
        self.aux_free_bias, self.bias_update_rate = opts.aux_free_bias, opts.bias_update_rate
        self.capacity_factor = opts.capacity_factor
        d = config.hidden_size
        f = opts.expert_intermediate_size or config.intermediate_size // (self.top_k + self.num_shared)
        self.hidden_size, self.expert_size = d, f
        self.init_std, self.residual_scale = config.initializer_range, ffn_residual_scale(config)

        # Stacked expert weights, laid out for x @ W: gate and up fused into one [d, 2f] matrix.
        self.gate_up_proj = nn.Parameter(torch.empty(E, d, 2 * f))
        self.down_proj = nn.Parameter(torch.empty(E, f, d))
        self.shared = SwiGLU(config, layer_idx, intermediate_size=self.num_shared * f) if self.num_shared else None
        # After the shared experts: transformers initialises submodules in the order they were registered,
        # and the router's init draws after the shared experts' as it always has (a seeded model's weights
        # are unchanged; tests/test_moe_routers.py test_topk_lm_seeded_init_is_unchanged).
        self.router = router
        if self.aux_free_bias:
            self.register_buffer("expert_bias", torch.zeros(E), persistent=True)
        # Selection counts since the last optimizer step (aux-free balancing). A plain attribute, not
        # a buffer: DDP would overwrite it with rank 0's counts at every forward.
        self.pending_counts: torch.Tensor | None = None
        self.expert_parallel = None  # an ExpertParallel once shard_experts() split the experts over processes

    def init_parameters(self) -> None:
        init.normal_(self.gate_up_proj, mean=0.0, std=self.init_std)
        init.normal_(self.down_proj, mean=0.0, std=self.init_std * self.residual_scale)
        if self.aux_free_bias:
            init.zeros_(self.expert_bias)

    # forward -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, aux=None, token_ids: torch.Tensor | None = None,
                real: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., d]; token_ids [...] (the input ids of x's tokens; router=hash and reinforce need them); real [...]
        (a padded batch: False at a pad) leaves the pads out of routing, capacity and the statistics (their output
        is 0)."""
        if real is not None:
            rows = torch.arange(x.shape[0], device=x.device)[:, None].expand(real.shape)[real]
            out = self.route(x[real], aux, None if token_ids is None else token_ids[real], rows, x.shape[0])
            return out.new_zeros(*real.shape, out.shape[-1]).index_put((real,), out)
        rows = x.shape[0] if x.dim() == 3 else 1  # the sequences of the sequence-wise loss
        token_rows = torch.arange(rows, device=x.device).repeat_interleave(x[..., 0].numel() // rows)
        return self.route(x.reshape(-1, x.shape[-1]), aux, token_ids, token_rows, rows).view(x.shape)

    def route(self, x: torch.Tensor, aux, token_ids: torch.Tensor | None, token_rows: torch.Tensor,
              rows: int) -> torch.Tensor:
        """The layer on x [N, d], whose tokens belong to sequences token_rows [N] of `rows`."""
        N, k, E = x.shape[0], self.top_k, self.num_experts
        routing = self.router(x, token_ids, self.expert_bias if self.aux_free_bias else None, aux, token_rows)

        # Sort the S assignments by expert; stable, so tokens keep their order.
        flat = routing.expert
        order = flat.argsort(stable=True)
        routed = torch.bincount(flat, minlength=E)
        counts = routed
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * N * k / E)
            rank = torch.arange(flat.numel(), device=x.device) - (routed.cumsum(0) - routed)[flat[order]]
            order = order[rank < capacity]
            counts = routed.clamp(max=capacity)
        token = routing.token[order]
        xs = x.index_select(0, token)
        # Experts run in the autocast dtype when autocast is on (as nn.Linear would), else in x's.
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        xs = xs.to(dtype)
        if self.expert_parallel is None:
            ys = self.local_experts(xs, counts)
        else:  # the rows go to the ranks that hold their experts and come back
            ys = self.expert_parallel.run(xs, counts, self.local_experts)
        ys = ys * routing.gate[order].unsqueeze(-1).to(ys.dtype)
        y = ys.new_zeros(x.shape).index_add(0, token, ys)
        if self.shared is not None:
            y = y + self.shared(x)

        if self.training and self.aux_free_bias:
            c = routed.detach().float()
            self.pending_counts = c if self.pending_counts is None else self.pending_counts + c
        if aux is not None:
            self.report(aux, routing, routed, token, N, token_rows, rows)
        return y

    def local_experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This process's experts (all of them without expert parallelism) on xs [S, d], whose rows are
        grouped by expert, counts [E_local] rows each."""
        w_gu, w_d = self.gate_up_proj.to(xs.dtype), self.down_proj.to(xs.dtype)
        if xs.is_cuda and grouped_mm_takes(xs.dtype, self.hidden_size, self.expert_size):
            return experts_grouped_mm(xs, w_gu, w_d, counts)
        return ExpertsLoop.apply(xs, w_gu, w_d, counts.tolist())

    def shard_experts(self, expert_parallel) -> None:
        """Keep only this rank's experts (expert_parallel.experts of the E), as parameters of the same
        names, and exchange rows with the other ranks from now on (model/ffn/expert_parallel.py)."""
        keep = expert_parallel.experts
        self.gate_up_proj = nn.Parameter(self.gate_up_proj.detach()[keep].clone())
        self.down_proj = nn.Parameter(self.down_proj.detach()[keep].clone())
        self.expert_parallel = expert_parallel

    def report(self, aux, routing: Routing, routed: torch.Tensor, kept_tokens: torch.Tensor, num_tokens: int,
               token_rows: torch.Tensor, rows: int) -> None:
        """Aux losses (always, for routers with scores) and load telemetry (training only) for this layer, over the
        forward's tokens: under context parallelism over the whole sequences, every slice's statistics summed over
        the context group first (aux.over_sequence, aux.sequence_mean), so that each rank reports one process's."""
        E, G, tag = self.num_experts, self.num_groups, f"moe/layer{self.layer_idx}"
        probs = routing.probs
        routed = aux.over_sequence(routed)  # assignments per expert, over the whole sequences
        frac = routed.to(torch.float32 if probs is None else probs.dtype) / routed.sum()  # f_i, share of assignments routed to i
        group_frac = frac.view(G, E // G).sum(-1)
        losses = {}
        if probs is not None:
            P = aux.sequence_mean(probs)
            losses["balance_loss"] = E * (frac * P).sum()
            losses["z_loss"] = aux.sequence_mean(torch.logsumexp(routing.logits, dim=-1).square())
            losses["sequence_balance_loss"] = sequence_balance_loss(routing, token_rows, rows, aux)
            if G > 1:
                losses["group_balance_loss"] = G * (group_frac * P.view(G, E // G).sum(-1)).sum()
            for name, value in losses.items():
                aux.add_loss(f"moe/{name}", value, getattr(self, f"{name}_coef"))
        if not self.training:
            return
        with torch.no_grad():
            metrics = {name: value.detach() for name, value in losses.items()}
            metrics.update({
                "imbalance": frac.max() * E,  # max load / mean load
                "load_cv": frac.std(correction=0) * E,  # std / mean
                "dead_experts": (routed == 0).sum().float(),
            })
            if probs is not None:
                metrics["router_entropy"] = aux.sequence_mean(-(probs * probs.clamp_min(1e-20).log()).sum(-1))  # nats
            kept = aux.over_sequence(torch.tensor([kept_tokens.numel(), routing.token.numel()], device=routed.device))
            metrics["dropped_frac"] = 1 - kept[0] / kept[1]
            metrics["unrouted_frac"] = aux.sequence_mean((torch.bincount(kept_tokens, minlength=num_tokens) == 0).float())
            if routing.token_choice_overlap is not None:
                metrics["token_choice_overlap"] = routing.token_choice_overlap
            if G > 1:
                metrics["group_imbalance"] = group_frac.max() * G
            for name, value in metrics.items():
                if name not in LOSSES:
                    aux.add_metric(f"moe/{name}", value)
                aux.add_metric(f"{tag}/{name}", value)
            aux.add_metric(f"{tag}/load", frac)
            if G > 1:
                aux.add_metric(f"{tag}/group_load", group_frac)

    def refuses_context_parallel(self) -> tuple[str, str] | None:
        """(the option, what is valid) where this layer cannot run under context parallelism, else None: its statistics
        are reduced over the context group (report), but a router that routes over the whole batch or learns from each
        token's loss (its context_parallel), or a capacity that drops the earliest tokens' overflow, would route
        differently on a slice."""
        if not self.router.context_parallel:
            fit = [name for name in ROUTERS.names() if ROUTERS.get(name).context_parallel]
            return f"ffn.options.router={self.router_name}", f"one of {', '.join(fit)}"
        if self.capacity_factor is not None:
            return f"ffn.options.capacity_factor={self.capacity_factor}", "null"
        return None

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
    def flops_per_token(self) -> float:
        """Router + the routed experts a token runs through in training + shared experts (forward, 2
        FLOPs per multiply-add)."""
        d, f = self.hidden_size, self.expert_size
        return self.router.flops_per_token() + 2 * 3 * d * f * (self.router.experts_per_token() + self.num_shared)

    def inactive_parameters(self) -> int:
        """Routed-expert parameters a token does not use: (E - k) experts."""
        return (self.num_experts - self.top_k) * 3 * self.hidden_size * self.expert_size


def sequence_balance_loss(routing: Routing, token_rows: torch.Tensor, rows: int, aux=None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: E sum_i f_i P_i within each of the `rows` sequences of
    the forward (token_rows [N]: each token's; f: the sequence's shares of assignments, P: its mean probs), averaged
    over them (under context parallelism over the whole sequences: aux.over_sequence)."""
    E = routing.probs.shape[1]
    counts = routing.probs.new_zeros(rows, E).index_put_(
        (token_rows[routing.token], routing.expert), routing.probs.new_ones(()), accumulate=True)
    prob_sums = routing.probs.new_zeros(rows, E).index_add(0, token_rows, routing.probs)
    tokens = torch.bincount(token_rows, minlength=rows).to(prob_sums.dtype)
    if aux is not None:  # one reduction of the three
        counts, prob_sums, tokens = aux.over_sequence(torch.cat([counts, prob_sums, tokens[:, None]], 1)).split(
            [E, E, 1], 1)
        tokens = tokens[:, 0]
    frac = counts / counts.sum(-1, keepdim=True).clamp_min(1)
    return E * (frac * prob_sums / tokens[:, None]).sum(-1).mean()
