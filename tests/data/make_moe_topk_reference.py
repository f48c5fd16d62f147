"""Writes tests/data/moe_topk_reference.pt: the top-k MoE layer and a tiny LM with a MoE layer (weights,
inputs, outputs, gradients, aux metrics) as computed by the code before the router refactor (commit
a0965e7; run there, with the repo pip-installed, as `python tests/data/make_moe_topk_reference.py`).
tests/test_moe_routers.py checks that router=topk still gives these numbers."""
import math
import torch
from model import DecoderLM, LMConfig
from model.ffn.moe import MoE
from model.layers import AuxCollector

torch.set_num_threads(1)
CASES = [
    dict(top_k=1, norm_topk_prob=False),
    dict(top_k=2),
    dict(top_k=3, num_shared_experts=2, score_func="sigmoid", route_scale=2.5),
    dict(top_k=2, capacity_factor=0.7),
    dict(top_k=2, aux_free_bias=True, capacity_factor=1.0),
]

def layer_case(options, dtype, seed):
    config = LMConfig(hidden_size=12, num_hidden_layers=2, ffn="moe",
                      ffn_options={"moe": dict(num_experts=6, expert_intermediate_size=7, **options)})
    m = MoE(config, layer_idx=1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / math.sqrt(p.shape[-1]))
        if m.aux_free_bias:
            m.expert_bias.copy_(0.05 * torch.randn(6, generator=g))
    m = m.to(dtype)
    x = torch.randn(3, 11, 12, generator=g, dtype=dtype, requires_grad=True)
    gy = torch.randn(3, 11, 12, generator=g, dtype=dtype)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    m.train()
    aux = AuxCollector()
    y = m(x, aux)
    ((y * gy).sum() + aux.total_loss()).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    return dict(options=options, dtype=dtype, state=state, x=x.detach().clone(), gy=gy, y=y.detach(),
                grad_x=x.grad.clone(), grads=grads, summary=aux.summary(),
                pending_counts=None if m.pending_counts is None else m.pending_counts.clone())

layers = [layer_case(o, torch.float64, i) for i, o in enumerate(CASES)]
layers += [layer_case(CASES[1], torch.float32, 10), layer_case(CASES[4], torch.float32, 11)]

torch.manual_seed(0)
config = LMConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                  ffn=["dense", "moe"], ffn_options={"moe": dict(num_experts=4, top_k=2, expert_intermediate_size=8,
                                                              num_shared_experts=1, aux_free_bias=True)})
lm = DecoderLM(config)
with torch.no_grad():
    lm.layers[1].ffn.expert_bias.copy_(torch.tensor([0.02, -0.01, 0.0, -0.01]))
ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
state = {k: v.clone() for k, v in lm.state_dict().items()}
out = lm(ids, labels=ids)
out.loss.backward()
lm_ref = dict(config=config.to_dict(), state=state, ids=ids, logits=out.logits.detach(), loss=out.loss.detach(),
              aux=out.aux_metrics, grads={n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None})
torch.save({"layers": layers, "lm": lm_ref}, "tests/data/moe_topk_reference.pt")
print("ok")
