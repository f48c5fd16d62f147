"""The router interface (model/ffn/routers/__init__.py describes it), what every router
returns, and the pieces several routers share: router logits and scores, token choice (optionally
group-limited) and its gates, the options of those pieces, and the evaluation routing of the routers
that are not causal.

A router maps the N tokens of one forward to a list of S assignments (token t_s goes to expert e_s
with gate g_s); the MoE sorts them by expert and runs each expert on its tokens (model/ffn/moe.py).
Token choice gives S = N k (the k slots of each token in order); expert choice gives each expert its
own tokens, so a token may get 0..E experts.

Group-limited routing (DeepSeek-V3, arXiv:2412.19437 sec. 2.1.2, "node-limited routing"): the E
experts form the MoE's G contiguous groups (devices once experts are split across processes); a
token first picks the M groups with the largest sum of their top ceil(k / M) scores, then its top-k
experts among those groups only.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import initialization as init

from model.options import bad_option, option
SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class Routing:
    token: torch.Tensor                 # [S] long: the token of each assignment (index into the N tokens)
    expert: torch.Tensor                # [S] long
    gate: torch.Tensor                  # [S]: the weight of the expert's output in the token's sum
    logits: torch.Tensor | None = None  # [N, E] router logits (fp32 or wider): z-loss; None without router weights
    probs: torch.Tensor | None = None   # [N, E] scores normalised to sum 1 per token: balance losses, entropy
    # Training routing that is not token choice: the share of the N k (token, expert) pairs of token
    # choice on the same scores (the routing used at evaluation) that training routing also makes.
    token_choice_overlap: torch.Tensor | None = None

    @classmethod
    def from_token_choice(cls, experts: torch.Tensor, gates: torch.Tensor, **rest) -> "Routing":
        """experts, gates [N, k] -> the N k assignments, token-major (t, slot 0), (t, slot 1), ..."""
        N, k = experts.shape
        token = torch.arange(N, device=experts.device).repeat_interleave(k)
        return cls(token, experts.flatten(), gates.flatten(), **rest)


class Router(nn.Module):
    """What the MoE may ask of any router besides forward, init_parameters and flops_per_token."""
    causal = True                 # a token's training experts depend on that token alone (else: BatchRouter)
    takes_selection_bias = False  # forward adds selection_bias (the MoE's aux-free bias) to its choice
    takes_z_loss = True           # the MoE's z-loss (z_loss_coef) applies to its logits (else: logged only)
    # it routes and learns as well on a slice of each sequence as on the whole (context parallelism): its routing
    # is causal and its losses are the MoE's, which reduces them over the context group (model/ffn/moe.py)
    context_parallel = True

    def experts_per_token(self) -> float:
        """Mean experts a token runs through in training (the MoE's FLOPs)."""
        return float(self.top_k)


# Options several routers share; each router's Options inherits those it uses.
@dataclass
class GateScaleOptions:
    route_scale: float = option(1.0)             # every gate times this


@dataclass
class TokenChoiceGateOptions(GateScaleOptions):
    norm_topk_prob: bool = option(True)          # renormalise a token's k gates to sum 1


@dataclass
class ScoreOptions:
    score_func: str = option("softmax", choices=SCORE_FUNCS)
    max_groups_per_token: int | None = option(None, at_least=1)  # M: token choice from at most M groups; None: any


class ScoredRouter(nn.Linear, Router):
    """A router with weights W_r [E, d]: logits = x W_r^T in fp32 at least. An nn.Linear (no bias) that
    routes instead of projecting: its weight is a hidden matrix to Muon (training/optim.py muon_split),
    its state key `router.weight`, and building it draws from the RNG as the router's nn.Linear always
    did, so a seeded model's init is unchanged. Init as DeepSeek-V3 / Qwen2-MoE: N(0, initializer_range)."""

    def __init__(self, config, layer_idx: int, moe):
        super().__init__(config.hidden_size, moe.num_experts, bias=False)
        self.layer_idx = layer_idx
        self.num_experts, self.top_k, self.num_groups = moe.num_experts, moe.top_k, moe.num_expert_groups
        self.init_std = config.initializer_range
        self.options = moe.options_for_router(self.Options)

    def init_parameters(self) -> None:
        init.normal_(self.weight, mean=0.0, std=self.init_std)

    def flops_per_token(self) -> float:
        """The logits (forward, 2 FLOPs per multiply-add)."""
        return 2 * self.in_features * self.num_experts

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, d] -> x W_r^T [N, E], in fp32 at least (float64 stays float64)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dtype), self.weight.to(dtype))

    def token_choice_gates(self, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """g = route_scale s_{t,i} for the chosen i, renormalised to sum route_scale if norm_topk_prob
        (a router whose Options has TokenChoiceGateOptions)."""
        gates = scores.gather(-1, experts)
        if self.options.norm_topk_prob:
            gates = gates / gates.sum(-1, keepdim=True)
        return gates * self.options.route_scale


class TokenChoiceRouter(ScoredRouter):
    """A scored router with ScoreOptions: scores softmax or sigmoid of the logits, and token choice on
    them from at most max_groups_per_token groups (top-k always; expert choice and balanced at evaluation)."""

    def __init__(self, config, layer_idx: int, moe):
        super().__init__(config, layer_idx, moe)
        E, k, G, M = self.num_experts, self.top_k, self.num_groups, self.options.max_groups_per_token
        if M is not None and not (math.ceil(k / (E // G)) <= M <= G):
            raise bad_option(f"{moe.router} router", "max_groups_per_token", M,
                             f"{math.ceil(k / (E // G))}..num_expert_groups={G} (top_k={k} from groups of {E // G})")

    def scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, d] -> logits, scores, probs [N, E] (probs: scores normalised to sum 1 per token)."""
        logits = self.logits(x)
        if self.options.score_func == "softmax":
            scores = logits.softmax(-1)
            return logits, scores, scores
        scores = logits.sigmoid()
        return logits, scores, scores / scores.sum(-1, keepdim=True)

    def token_choice(self, choice: torch.Tensor) -> torch.Tensor:
        """Each token's top-k experts [N, k] by `choice` [N, E] (scores, plus a selection bias), from at
        most max_groups_per_token groups."""
        return token_choice(choice, self.top_k, self.num_groups, self.options.max_groups_per_token)


class BatchRouter(TokenChoiceRouter):
    """A router whose training routing is not causal (a token's experts depend on the other tokens of
    the batch, later ones included), which evaluation and decoding cannot use: they route by token
    choice on the same scores, unless its evaluation variant "batch_routing" is on (model/layers.py eval_variant),
    which has evaluation route as training does, over each evaluation forward's batch."""
    causal = False
    context_parallel = False  # its training routing needs the whole batch's scores
    eval_variants = ("batch_routing",)

    def __init__(self, config, layer_idx: int, moe):
        super().__init__(config, layer_idx, moe)
        self.batch_at_eval = False

    def set_eval_variant(self, name: str | None) -> None:
        self.batch_at_eval = name == "batch_routing"

    def routes_batch(self) -> bool:
        """Whether this forward routes over the batch (training, or evaluation with batch routing on)."""
        return self.training or self.batch_at_eval

    def overlap(self, routing: Routing, scores: torch.Tensor) -> torch.Tensor:
        """The share of token choice's N k pairs (on these scores, no bias) that `routing` also makes."""
        N, E = scores.shape
        chosen = torch.zeros(N, E, dtype=torch.bool, device=scores.device)
        chosen[routing.token, routing.expert] = True
        return chosen.gather(1, self.token_choice(scores.detach())).float().mean()


def group_limit(choice: torch.Tensor, num_groups: int, max_groups: int, top_k: int) -> torch.Tensor:
    """choice [N, E] with -inf outside each token's max_groups best groups (a group's score: the sum
    of its top ceil(k / M) entries, DeepSeek-V3)."""
    N, E = choice.shape
    grouped = choice.view(N, num_groups, E // num_groups)
    per_group = min(E // num_groups, math.ceil(top_k / max_groups))
    best = grouped.topk(per_group, dim=-1).values.sum(-1).topk(max_groups, dim=-1).indices  # [N, M]
    allowed = torch.zeros(N, num_groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return grouped.masked_fill(~allowed[..., None], float("-inf")).view(N, E)


def token_choice(choice: torch.Tensor, top_k: int, num_groups: int = 1, max_groups: int | None = None) -> torch.Tensor:
    """The top-k experts [N, k] of each row of choice [N, E], from at most max_groups of num_groups groups."""
    if max_groups is not None and max_groups < num_groups:
        choice = group_limit(choice, num_groups, max_groups, top_k)
    return choice.topk(top_k, dim=-1).indices
