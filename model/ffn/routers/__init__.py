"""MoE routers, one file each, registered by name in ROUTERS and chosen by the MoE option `router`
(ffn.options.router=...); this package imports every module of itself, so a new router is one file:

    topk           token choice: each token its k best experts (topk.py)
    expert_choice  each expert its C best tokens of the batch; token choice at evaluation (expert_choice.py)
    hash           a fixed balanced hash of the input token id, no weights (hash.py)
    balanced       balanced assignment (Sinkhorn + exact rounding); token choice at evaluation (balanced.py)
    reinforce      a policy that samples k experts, trained by REINFORCE on the token's LM loss; greedy
                   top-k at evaluation (reinforce.py)

Interface (the MoE in model/ffn/moe.py owns the dispatch, capacity, the balance losses and their logging):

    @ROUTERS.register("name")
    class Name(Router):                       # routing.py: Router, or ScoredRouter and its subclasses
        Options = NameOptions                 # a dataclass of model/options.py `option` fields: only what it uses
        router = Name(config: LMConfig, layer_idx: int, moe: MoEOptions)
            # its options: moe.options_for_router(Options), from the MoE's router_options (checked there, one line)
        routing = router(x [N, d], token_ids: [B, T] or [N] | None, selection_bias: [E] | None,
                         aux: AuxCollector | None, token_rows: [N] | None)
            # -> Routing (routing.py); token_ids: x's input ids; selection_bias: the MoE's aux-free bias;
            # token_rows: each token's row (non-decreasing; a padded batch routes only its real tokens, [N] of them)
        router.init_parameters()              # its own parameters, through transformers.initialization
        router.flops_per_token() -> float     # its own forward FLOPs per token (the MoE adds the experts')
        router.experts_per_token() -> float   # experts a token runs through in training (default k)

    optional:
        takes_selection_bias = True           # it uses selection_bias (the MoE refuses aux_free_bias otherwise)
        takes_z_loss = False                  # the MoE's z-loss only logged, not weighed in (reinforce, by default)
        context_parallel = False              # refused under context parallelism (expert_choice, balanced, reinforce)
        no_weight_decay() -> tuple[str, ...]  # its parameters the optimizer does not decay (training/optim.py)
        causal = False + eval_variants = ("batch_routing",) + set_eval_variant(name)  # BatchRouter: training
                                              # routing over the batch, token choice at evaluation unless the
                                              # variant is on (model/layers.py eval_variant)
        aux.on_token_loss(consume, with_eval_loss)  # in forward: consume(aux, token_loss [N], labelled [N],
                                              # eval_loss [N] | None) once the model knows each token's LM loss
                                              # (reinforce; eval_loss: under the evaluation forward, if asked)
        after_optimizer_step()                # called after every optimizer step (training/loop.py), as for any module

The router reads `self.training`: training and evaluation routing differ for the routers that are not
causal and for reinforce (sampling against greedy).
"""
import importlib
import pkgutil

from model.ffn.routers.routing import Router, Routing
from model.registry import ROUTERS

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["ROUTERS", "Router", "Routing"]
