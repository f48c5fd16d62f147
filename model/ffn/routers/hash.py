"""Hash routing (Roller et al. 2021, "Hash Layers For Large Sparse Models", arXiv:2106.04426): a
token's experts are a fixed function of its input token id; no router weights, nothing learnt.

The hash is balanced across a frequency-ordered vocabulary (the paper's "balanced assignment"; BPE
ids are roughly in frequency order): the ids are cut into blocks of E consecutive ids, and within
block b = id // E, slot j (0 <= j < k) of id = b E + r goes to expert

    e_j(id) = (a_b (r + j) + c_b) mod E,    a_b a unit mod E, c_b in [0, E), both from a fixed integer
                                            hash of b (Knuth's multiplicative hash)

so each block's E ids go to E distinct experts in every slot (the most frequent ids spread evenly), a
token's k experts are distinct, and which ids share an expert changes from block to block. The same
id gets the same experts at every position, call and layer, in training, evaluation and decoding.
Gates: route_scale (the paper's top-1 has none), split evenly over the k experts if norm_topk_prob.
The ids reach the MoE through the forward (DecoderLM -> Block -> FFN). Options: norm_topk_prob,
route_scale. No scores, so the MoE has no balance or z-loss to add (its loss coefficients do nothing).
"""
import math

import torch

from model.ffn.routers.routing import Router, Routing, TokenChoiceGateOptions
from model.registry import ROUTERS

KNUTH = 2654435761  # floor(2^32 / golden ratio), prime


@ROUTERS.register("hash")
class Hash(Router):
    Options = TokenChoiceGateOptions

    def __init__(self, config, layer_idx: int, moe):
        super().__init__()
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        options = moe.options_for_router(self.Options)
        self.gate = options.route_scale / (moe.top_k if options.norm_topk_prob else 1)
        self.units = [a for a in range(1, self.num_experts) if math.gcd(a, self.num_experts) == 1] or [1]

    def init_parameters(self) -> None:
        """No parameters."""

    def flops_per_token(self) -> float:
        return 0.0  # no router weights; the gates are constants

    def experts(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token ids [N] -> their experts [N, k]."""
        E = self.num_experts
        block, r = token_ids // E, token_ids % E
        h = block * KNUTH % 2**32
        a = torch.tensor(self.units, device=token_ids.device)[(h >> 16) % len(self.units)]
        c = (h >> 8) % E
        slots = torch.arange(self.top_k, device=token_ids.device)
        return (a[:, None] * (r[:, None] + slots) + c[:, None]) % E

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None,
                selection_bias: torch.Tensor | None = None, aux=None, token_rows: torch.Tensor | None = None) -> Routing:
        if token_ids is None or token_ids.numel() != x.shape[0]:
            raise ValueError("router=hash needs the input token ids of the forward's tokens (moe(x, aux, token_ids))")
        experts = self.experts(token_ids.reshape(-1))
        gates = torch.full(experts.shape, self.gate, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        return Routing.from_token_choice(experts, gates)
