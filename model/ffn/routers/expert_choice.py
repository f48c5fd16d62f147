"""Expert choice (Zhou et al. 2022, "Mixture-of-Experts with Expert Choice Routing", arXiv:2202.09368):
each expert takes its C best tokens of the forward's batch.

    S = softmax(X W_r^T)  or  sigmoid(...)               [N, E], fp32 (at least)
    C = min(N, ceil(c N k / E))                          c: capacity_factor (its own option)
    expert i takes the C tokens of largest S[:, i]; gate g_{t,i} = route_scale S[t, i] (as the paper: no
    renormalisation over a token's experts, whose number varies from 0 to E)

Every expert gets exactly C tokens (no balance loss needed; logged all the same). A token may get no
expert (logged: moe/unrouted_frac) or several. Not causal (routing.py BatchRouter): whether a token is
taken depends on the other tokens of the batch, later ones included, which evaluation and decoding
cannot use. There the router falls back to token choice on the same scores: each token's top-k
experts (group-limited if max_groups_per_token is set), gates route_scale S[t, i] as in training.
Training logs how far the two routings are apart (moe/token_choice_overlap: the share of token
choice's N k pairs that expert choice also made on the same batch).
"""
import math
from dataclasses import dataclass

import torch

from model.ffn.routers.routing import BatchRouter, GateScaleOptions, Routing, ScoreOptions
from model.options import option
from model.registry import ROUTERS


@dataclass
class ExpertChoiceOptions(ScoreOptions, GateScaleOptions):
    capacity_factor: float = option(1.0, above=0)  # c: each expert takes ceil(c N k / E) tokens


@ROUTERS.register("expert_choice")
class ExpertChoice(BatchRouter):
    Options = ExpertChoiceOptions

    def capacity(self, num_tokens: int) -> int:
        return min(num_tokens, math.ceil(self.options.capacity_factor * num_tokens * self.top_k / self.num_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None,
                selection_bias: torch.Tensor | None = None, aux=None, token_rows: torch.Tensor | None = None) -> Routing:
        logits, scores, probs = self.scores(x)
        scale = self.options.route_scale
        if not self.routes_batch():
            experts = self.token_choice(scores.detach())
            return Routing.from_token_choice(experts, scores.gather(-1, experts) * scale, logits=logits, probs=probs)
        C = self.capacity(x.shape[0])
        gates, tokens = scores.t().topk(C, dim=-1)  # [E, C]: each expert's C best tokens
        experts = torch.arange(self.num_experts, device=x.device).repeat_interleave(C)
        routing = Routing(tokens.flatten(), experts, gates.flatten() * scale, logits=logits, probs=probs)
        if self.training:
            routing.token_choice_overlap = self.overlap(routing, scores)
        return routing

    def experts_per_token(self) -> float:
        """Mean experts a token runs through in training: c k."""
        return self.options.capacity_factor * self.top_k
