"""Balanced assignment (BASE layers, Lewis et al. 2021, arXiv:2103.16716, in its Sinkhorn form as in
Clark et al. 2022, arXiv:2202.01169 "S-BASE"): at training, the N tokens of the forward are assigned
to experts so that every expert gets the same number of (token, expert) pairs, N k / E (when E
divides N k; else at most ceil(N k / E)), each token exactly k distinct experts.

    P = Sinkhorn(log s)        sinkhorn_iterations alternate normalisations of the affinities
                               s [N, E] (exp of log s) to row sums k and column sums N k / E
    rounding                   experts in order i = 0..E-1 each take their ceil(N k / E) tokens of
                               largest P[:, i] among those that still need an expert, always including
                               the tokens that need every expert not yet visited (so that the rest
                               stays feasible: Gale-Ryser, needs <= experts left), exact for any P
    gates                      as top-k's: route_scale s_{t,i} [/ sum over the token's k experts]

BASE solves the assignment exactly (an auction); this greedy rounding of the Sinkhorn plan is exactly
balanced but not the optimal assignment. Not causal (routing.py BatchRouter: a token's experts depend
on the other tokens of the batch): evaluation and decoding use top-k token choice on the same scores,
and training logs moe/token_choice_overlap, the share of token choice's pairs that the balanced
assignment also makes. Options: topk's, and sinkhorn_iterations.
"""
import math
from dataclasses import dataclass

import torch

from model.ffn.routers.routing import BatchRouter, Routing, ScoreOptions, TokenChoiceGateOptions
from model.options import option
from model.registry import ROUTERS


@dataclass
class BalancedOptions(ScoreOptions, TokenChoiceGateOptions):
    sinkhorn_iterations: int = option(10, at_least=0)  # 0: round the raw scores


@ROUTERS.register("balanced")
class Balanced(BatchRouter):
    Options = BalancedOptions

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None,
                selection_bias: torch.Tensor | None = None, aux=None, token_rows: torch.Tensor | None = None) -> Routing:
        logits, scores, probs = self.scores(x)
        if self.routes_batch():
            experts = balanced_assignment(scores.detach().clamp_min(1e-30).log(), self.top_k, self.options.sinkhorn_iterations)
        else:
            experts = self.token_choice(scores.detach())
        routing = Routing.from_token_choice(experts, self.token_choice_gates(scores, experts), logits=logits, probs=probs)
        if self.training:
            routing.token_choice_overlap = self.overlap(routing, scores)
        return routing


def sinkhorn(log_affinity: torch.Tensor, top_k: int, iterations: int) -> torch.Tensor:
    """log P [N, E]: log_affinity plus row and column offsets, normalised in turn to row sums k and
    column sums N k / E (the balanced transport plan of the entropic assignment problem)."""
    N, E = log_affinity.shape
    log_p = log_affinity
    for _ in range(iterations):
        log_p = log_p - (log_p.logsumexp(1, keepdim=True) - math.log(top_k))
        log_p = log_p - (log_p.logsumexp(0, keepdim=True) - math.log(N * top_k / E))
    return log_p


@torch.no_grad()
def balanced_assignment(log_affinity: torch.Tensor, top_k: int, iterations: int) -> torch.Tensor:
    """Each token's k distinct experts [N, k] (ascending), every expert getting at most ceil(N k / E)
    tokens (exactly N k / E when E divides N k)."""
    N, E = log_affinity.shape
    priority = sinkhorn(log_affinity, top_k, iterations)
    capacity = min(N, math.ceil(N * top_k / E))
    need = torch.full((N,), top_k, device=log_affinity.device)
    taken = torch.zeros(N, E, dtype=torch.bool, device=log_affinity.device)
    for i in range(E):
        p = priority[:, i].masked_fill(need == E - i, float("inf")).masked_fill(need == 0, float("-inf"))
        values, tokens = p.topk(capacity)
        taken[:, i].scatter_(0, tokens, values > float("-inf"))
        need = need - taken[:, i].long()
    return taken.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[:, :top_k]
