"""Top-k token choice (Shazeer et al. 2017, arXiv:1701.06538; as GShard / Switch / DeepSeek-V3):
each token picks its k best experts.

    s_t = softmax(x_t W_r^T)  or  sigmoid(x_t W_r^T)              fp32 (at least)
    K_t = topk_i(s_{t,i} + b_i)                                   b: the MoE's aux-free bias, selection only
    g_{t,i} = route_scale s_{t,i} [/ sum_{j in K_t} s_{t,j}]     renormalised if norm_topk_prob

The same at training, evaluation and decoding (a token's experts depend on that token only).
With k = 1 and norm_topk_prob the gate is always 1, so the router then learns only from the
balance losses. Options: score_func, max_groups_per_token (group-limited choice over the MoE's
num_expert_groups, routing.py), norm_topk_prob, route_scale.
"""
from dataclasses import dataclass

import torch

from model.ffn.routers.routing import Routing, ScoreOptions, TokenChoiceGateOptions, TokenChoiceRouter
from model.registry import ROUTERS


@dataclass
class TopKOptions(ScoreOptions, TokenChoiceGateOptions):
    """The scores, group-limited token choice and its gates."""


@ROUTERS.register("topk")
class TopK(TokenChoiceRouter):
    Options = TopKOptions
    takes_selection_bias = True

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None,
                selection_bias: torch.Tensor | None = None, aux=None, token_rows: torch.Tensor | None = None) -> Routing:
        logits, scores, probs = self.scores(x)
        choice = scores.detach()
        if selection_bias is not None:
            choice = choice + selection_bias.to(choice.dtype)
        experts = self.token_choice(choice)
        return Routing.from_token_choice(experts, self.token_choice_gates(scores, experts), logits=logits, probs=probs)
