"""Worker for tests/test_expert_parallel.py: one MoE layer per router in float64, its experts split over
EP ranks of a (W / EP) x EP mesh (training/parallel.py), against the same layer unsplit on every rank.

    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml --num_processes W -m tests.ep_worker OUT EP

Each rank routes its own tokens. The reference: the unsplit layer on every rank's tokens, the loss the
mean over ranks of <y_r, g_r> (g_r fixed random) plus the layer's aux losses (router=reinforce's with
the token losses <y_t, g_t>), its gradients. The split layer: each rank's loss backward, the router's and shared experts' gradients averaged over all ranks (as DDP does),
the experts' through reduce_and_clip_gradients. The main process writes OUT/ep<EP>_world<W>.json: the sizes that
ran and, per router, the largest difference of outputs, input gradients, router and expert gradients
and the gradient norm from the reference's."""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from model.ffn.routers import ROUTERS as REGISTERED

# Every registered router, with what it has beyond its defaults to exercise.
EXTRA = {"topk": dict(capacity_factor=1.5), "reinforce": dict(router_options=dict(baseline="value", entropy_coef=0.01))}
ROUTERS = {name: EXTRA.get(name, {}) for name in REGISTERED.names()}
E, D, TOKENS = 8, 16, 24


def layer(router: str):
    from model import LMConfig
    from model.ffn.moe import MoE

    torch.manual_seed(0)
    config = LMConfig(vocab_size=64, hidden_size=D, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                      ffn="moe", ffn_options={"moe": dict(router=router, num_experts=E, top_k=2, expert_intermediate_size=8,
                                                          num_shared_experts=1, **ROUTERS[router])})
    moe = MoE(config).double()
    moe.router.init_parameters()
    moe.init_parameters()
    return moe


def inputs(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(TOKENS, D, generator=g, dtype=torch.float64), torch.randint(0, 64, (TOKENS,), generator=g),
            torch.randn(TOKENS, D, generator=g, dtype=torch.float64))


def loss(moe, x, ids, g):
    """The layer's output and a loss: <y, g> plus its aux losses, the REINFORCE router's with the
    token losses <y_t, g_t>."""
    from model.layers import AuxCollector

    aux = AuxCollector()
    y = moe(x, aux, token_ids=ids)
    aux.give_token_loss(lambda: (y * g).sum(-1), torch.ones(len(x), dtype=torch.bool))
    extra = aux.total_loss()  # None for hash: no scores, no losses
    return y, (y * g).sum() + (0 if extra is None else extra)


def compare(router: str, ep: int) -> dict:
    from training.parallel import apply_expert_parallel, expert_parameters, reduce_and_clip_gradients

    W, rank = dist.get_world_size(), dist.get_rank()
    # the reference: every rank's tokens through the unsplit layer
    ref = layer(router).train()
    ref_y, ref_dx = [], []
    for r in range(W):
        x, ids, g = inputs(r)
        x.requires_grad_(True)
        y, total = loss(ref, x, ids, g)
        (total / W).backward()
        ref_y.append(y.detach())
        ref_dx.append(x.grad)
    ref_norm = torch.cat([p.grad.flatten() for p in ref.parameters() if p.grad is not None]).norm().item()

    # the split layer: this rank's tokens
    holder = torch.nn.ModuleList([layer(router).train()])
    mesh = apply_expert_parallel(holder, ep, W, "cpu")
    moe = holder[0]
    x, ids, g = inputs(rank)
    x.requires_grad_(True)
    y, total = loss(moe, x, ids, g)
    total.backward()  # this rank's loss; averaged over the ranks below, as DDP and the EP glue do
    experts = {id(p) for p in expert_parameters(holder)}
    for p in holder.parameters():  # DDP's averaging of the replicated parameters
        if id(p) not in experts and p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= W
    norm = reduce_and_clip_gradients(holder, mesh, None)

    def diff(a, b):
        return (a - b).abs().max().item()

    keep = moe.expert_parallel.experts
    errors = {"y": diff(y.detach(), ref_y[rank]), "dx": diff(x.grad / W, ref_dx[rank]), "norm": abs(norm - ref_norm)}
    for name, p in moe.named_parameters():
        want = dict(ref.named_parameters())[name].grad
        errors[f"d{name}"] = diff(p.grad, want[keep] if id(p) in experts else want)
    worst = torch.tensor([max(errors.values())], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"worst": worst.item(), **errors, "local_experts": moe.expert_parallel.local,
            "ep_size": moe.expert_parallel.size, "dp_size": mesh["dp"].size()}


def main(out: Path, ep: int) -> None:
    from accelerate import PartialState

    torch.set_num_threads(1)
    state = PartialState(cpu=True)
    result = {"world_size": state.num_processes, "routers": {router: compare(router, ep) for router in ROUTERS}}
    if state.is_main_process:
        (out / f"ep{ep}_world{state.num_processes}.json").write_text(json.dumps(result))
    state.wait_for_everyone()
    state.destroy_process_group()  # as the other workers do: exiting with gloo's threads alive can abort a rank


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
