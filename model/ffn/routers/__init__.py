"""MoE routers, one file each, chosen by the MoE option `router` (ffn.options.router=...):

    topk           token choice: each token its k best experts (model/ffn/routers/topk.py)
    expert_choice  each expert its C best tokens of the batch; token choice at evaluation (expert_choice.py)
    hash           a fixed balanced hash of the input token id, no weights (hash.py)
    balanced       balanced assignment (Sinkhorn + exact rounding); token choice at evaluation (balanced.py)
    reinforce      a policy that samples k experts, trained by REINFORCE on the token's LM loss; greedy
                   top-k at evaluation (reinforce.py)

Interface (the MoE in model/ffn/moe.py owns the dispatch, the balance losses and their logging):

    router = ROUTERS[name](hidden_size, opts)        opts: the MoE's options (MoEOptions)
    routing = router(x [N, d], token_ids [..] | None, selection_bias [E] | None) -> Routing (routing.py)
                                                    token_ids: x's input ids in the forward's layout ([B, T])

A router lists the MoE options it does not use in `unused_options` (they must keep their
defaults under it). The router reads `self.training`: training and evaluation routing differ for the routers whose
training routing is not causal (`causal = False`). A router with weights holds them as `weight`
[E, d], which the MoE initialises. Options of one router only are declared in its file (an Options
dataclass that MoEOptions inherits), named after it.
"""
from model.ffn.routers.balanced import Balanced, BalancedOptions
from model.ffn.routers.expert_choice import ExpertChoice, ExpertChoiceOptions
from model.ffn.routers.hash import Hash
from model.ffn.routers.reinforce import Reinforce, ReinforceOptions
from model.ffn.routers.routing import Routing
from model.ffn.routers.topk import TopK

ROUTERS = {"topk": TopK, "expert_choice": ExpertChoice, "hash": Hash, "balanced": Balanced, "reinforce": Reinforce}
# The options each router's own file declares (checked: they stay at their defaults under another router).
ROUTER_OPTIONS = {"expert_choice": ExpertChoiceOptions, "balanced": BalancedOptions, "reinforce": ReinforceOptions}

__all__ = ["ROUTERS", "ROUTER_OPTIONS", "Routing", "ExpertChoiceOptions", "BalancedOptions", "ReinforceOptions"]
