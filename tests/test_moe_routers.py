"""MoE routers (model/ffn/routers) and the balance levels of model/ffn/moe.py, in numbers: top-k
against the values the code gave before routers were an option; each router's assignment against a
naive reference (expert choice: exactly C tokens per expert, its C best; hash: one fixed, balanced
function of the id; balanced: N k / E tokens per expert); group-limited token choice within M
groups; the sequence-wise and device-level losses by hand; which parameters get gradients
(finite differences through each router); decoding with the cache and the HF round trip for every
router; evaluation with training routing; and the one-line errors. DDP: tests/test_moe_routers_ddp.py."""
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model import DecoderLM, LMConfig
from model.ffn.moe import MoE
from model.layers import eval_variant, eval_variant_names
from model.ffn.routers import ROUTERS
from model.ffn.routers.balanced import balanced_assignment
from model.ffn.routers.hash import KNUTH
from model.ffn.routers.routing import token_choice
from model.ffn.routers.topk import TopKOptions
from model.layers import AuxCollector
from test_moe import make_moe, randomise

F64 = torch.float64
REFERENCE = Path(__file__).parent / "data" / "moe_topk_reference.pt"

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- topk: the numbers of the code before the refactor ---------------------------------------------
def close(actual, expected, dtype):
    """fp64: to 1e-12; fp32: a few ulps (other CPUs may round matmuls differently)."""
    tol = 1e-12 if dtype == F64 else 1e-6
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def split_options(flat: dict) -> dict:
    """The reference's options, the MoE's and top-k's in one dict as they were then: top-k's in router_options."""
    own = {f.name for f in dataclasses.fields(TopKOptions)}
    return {**{k: v for k, v in flat.items() if k not in own}, "router_options": {k: v for k, v in flat.items() if k in own}}


@pytest.mark.parametrize("case", range(7))
def test_topk_layer_reproduces_the_values_before_routers(case):
    """tests/data/make_moe_topk_reference.py ran on the code before the refactor: same weights and
    inputs give the same output, gradients (of an output projection + the aux losses) and metrics."""
    ref = torch.load(REFERENCE, weights_only=False)["layers"][case]
    m = make_moe(num_experts=6, expert_intermediate_size=7, **split_options(ref["options"])).to(ref["dtype"])
    assert m.router.__class__.__name__ == "TopK"  # the default router
    m.load_state_dict(ref["state"])
    x = ref["x"].clone().requires_grad_()
    aux = AuxCollector()
    y = m(x, aux)
    ((y * ref["gy"]).sum() + aux.total_loss()).backward()
    close(y, ref["y"], ref["dtype"])
    close(x.grad, ref["grad_x"], ref["dtype"])
    for name, p in m.named_parameters():
        close(p.grad, ref["grads"][name], ref["dtype"])
    summary = aux.summary()
    for name, value in ref["summary"].items():
        close(summary[name], value, ref["dtype"] if value.dtype == F64 else torch.float32)
    if ref["pending_counts"] is not None:
        torch.testing.assert_close(m.pending_counts, ref["pending_counts"], rtol=0, atol=0)


def test_topk_lm_reproduces_the_values_before_routers():
    """The tiny LM (dense + MoE layer with a shared expert and the aux-free bias): the token ids now
    reach the FFN, which must change nothing for top-k."""
    ref = torch.load(REFERENCE, weights_only=False)["lm"]
    lm = DecoderLM(LMConfig.from_dict(ref["config"]))
    lm.load_state_dict(ref["state"])
    out = lm(ref["ids"], labels=ref["ids"])
    out.loss.backward()
    close(out.logits, ref["logits"], torch.float32)
    close(out.loss, ref["loss"], torch.float32)
    grads = {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(ref["grads"])
    for name, g in grads.items():
        close(g, ref["grads"][name], torch.float32)
    for name, value in ref["aux"].items():
        close(out.aux_metrics[name], value, torch.float32)


def test_topk_lm_seeded_init_is_unchanged():
    """The reference LM's weights are its seeded init (torch.manual_seed(0), then DecoderLM(config)) as
    the code before the refactor drew it, bar the aux-free bias it then set: the router must draw from
    the RNG at construction and initialise in the same order as before (shared experts included)."""
    ref = torch.load(REFERENCE, weights_only=False)["lm"]
    torch.manual_seed(0)
    state = DecoderLM(LMConfig.from_dict(ref["config"])).state_dict()
    assert sorted(state) == sorted(ref["state"])
    for name, value in ref["state"].items():
        if not name.endswith("expert_bias"):
            assert torch.equal(state[name], value), name


# ---- assignments against naive references ----------------------------------------------------------
def scores_layer(router: str, N: int = 12, E: int = 4, seed: int = 0, **options) -> tuple[MoE, torch.Tensor]:
    m = randomise(make_moe(d=10, num_experts=E, expert_intermediate_size=5, router=router, **options).double(), seed)
    x = torch.randn(N, 10, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    return m, x


def pairs(routing) -> set[tuple[int, int]]:
    return set(zip(routing.token.tolist(), routing.expert.tolist()))


def naive_expert_layer(m: MoE, x: torch.Tensor, chosen: dict[int, list[int]], gate) -> torch.Tensor:
    """y_t = sum over the experts i that took t of gate(t, i) E_i(x_t), per token."""
    f = m.expert_size
    y = torch.zeros_like(x)
    for i, tokens in chosen.items():
        for t in tokens:
            h = x[t] @ m.gate_up_proj[i]
            y[t] += gate(t, i) * ((F.silu(h[:f]) * h[f:]) @ m.down_proj[i])
    return y


@pytest.mark.parametrize("N,k,factor", [(12, 2, 1.0), (10, 2, 0.6), (9, 1, 2.0), (5, 3, 2.0)])
def test_expert_choice_takes_each_experts_C_best_tokens(N, k, factor):
    E = 4
    m, x = scores_layer("expert_choice", N=N, E=E, top_k=k, router_options=dict(capacity_factor=factor, route_scale=1.5))
    m.train()
    s = torch.softmax(x @ m.router.weight.T, -1).detach()
    C = min(N, math.ceil(factor * N * k / E))
    chosen = {i: sorted(range(N), key=lambda t: -float(s[t, i]))[:C] for i in range(E)}
    routing = m.router(x)
    assert routing.expert.bincount(minlength=E).tolist() == [C] * E
    assert pairs(routing) == {(t, i) for i, ts in chosen.items() for t in ts}
    aux = AuxCollector()
    y = m(x, aux)
    torch.testing.assert_close(y, naive_expert_layer(m, x, chosen, lambda t, i: 1.5 * s[t, i]), rtol=1e-12, atol=1e-12)
    # telemetry: tokens no expert took; how much of token choice (top-k per token) expert choice also made
    taken = {t for ts in chosen.values() for t in ts}
    top = [set(sorted(range(E), key=lambda i: -float(s[t, i]))[:k]) for t in range(N)]
    both = sum(t in chosen[i] for t in range(N) for i in top[t])
    summary = aux.summary()
    assert summary["moe/unrouted_frac"].item() == pytest.approx(1 - len(taken) / N)
    assert summary["moe/token_choice_overlap"].item() == pytest.approx(both / (N * k))
    if factor < 1:
        assert summary["moe/unrouted_frac"].item() > 0


def test_expert_choice_evaluates_with_token_choice_and_batch_routing_on_request():
    m, x = scores_layer("expert_choice", N=10, top_k=2, router_options=dict(route_scale=1.5))
    s = torch.softmax(x @ m.router.weight.T, -1).detach()
    m.eval()
    top = {i: [t for t in range(10) if i in sorted(range(4), key=lambda j: -float(s[t, j]))[:2]] for i in range(4)}
    token_choice_y = m(x)
    torch.testing.assert_close(token_choice_y, naive_expert_layer(m, x, top, lambda t, i: 1.5 * s[t, i]), rtol=1e-12, atol=1e-12)
    m.train()
    trained = m(x)
    m.eval()
    assert eval_variant_names(m) == ["batch_routing"]
    with eval_variant(m, "batch_routing"):
        torch.testing.assert_close(m(x), trained, rtol=0, atol=0)
    torch.testing.assert_close(m(x), token_choice_y, rtol=0, atol=0)  # token choice again after the context


def hash_experts(token_id: int, E: int, k: int) -> list[int]:
    """The hash of model/ffn/routers/hash.py in Python integers."""
    units = [a for a in range(1, E) if math.gcd(a, E) == 1] or [1]
    block, r = divmod(token_id, E)
    h = block * KNUTH % 2**32
    a, c = units[(h >> 16) % len(units)], (h >> 8) % E
    return [(a * (r + j) + c) % E for j in range(k)]


@pytest.mark.parametrize("E,k", [(8, 2), (6, 3), (4, 1), (16, 4)])
def test_hash_is_a_fixed_balanced_function_of_the_id(E, k):
    V = 40 * E
    m = make_moe(d=8, num_experts=E, top_k=k, expert_intermediate_size=4, router="hash")
    assert list(m.router.parameters()) == []
    ids = torch.arange(V)
    experts = m.router(torch.zeros(V, 8), ids).expert.view(V, k)
    assert experts.tolist() == [hash_experts(i, E, k) for i in range(V)]
    # balanced across a frequency-ordered vocabulary: every E consecutive ids (e.g. the E most
    # frequent) go to E distinct experts in each slot, so each expert gets V / E ids per slot
    for j in range(k):
        assert (experts[:, j].view(-1, E).sort(-1).values == torch.arange(E)).all()
    assert all(len(set(row)) == k for row in experts.tolist())  # k distinct experts
    assert len({tuple(experts[b * E: b * E + E, 0].tolist()) for b in range(40)}) > 1  # blocks differ
    # the same id: the same experts at every position and in every call, training or not
    seq = torch.randint(0, V, (3, 17), generator=torch.Generator().manual_seed(0))
    for training in (True, False):
        m.train(training)
        again = m.router(torch.randn(51, 8), seq).expert.view(51, k)
        assert again.tolist() == [hash_experts(i, E, k) for i in seq.flatten().tolist()]


def naive_sinkhorn(log_a: list[list[float]], k: int, iterations: int) -> list[list[float]]:
    N, E = len(log_a), len(log_a[0])
    p = [row[:] for row in log_a]
    for _ in range(iterations):
        for t in range(N):
            shift = math.log(sum(math.exp(v) for v in p[t])) - math.log(k)
            p[t] = [v - shift for v in p[t]]
        for i in range(E):
            shift = math.log(sum(math.exp(p[t][i]) for t in range(N))) - math.log(N * k / E)
            for t in range(N):
                p[t][i] -= shift
    return p


def naive_balanced(log_a: list[list[float]], k: int, iterations: int) -> list[list[int]]:
    """Experts in order, each taking the tokens that need every expert left, then its best others by
    the Sinkhorn plan, up to ceil(N k / E)."""
    p = naive_sinkhorn(log_a, k, iterations)
    N, E = len(p), len(p[0])
    need, taken = [k] * N, [[] for _ in range(N)]
    capacity = math.ceil(N * k / E)
    for i in range(E):
        critical = [t for t in range(N) if need[t] == E - i]
        others = sorted((t for t in range(N) if 0 < need[t] < E - i), key=lambda t: -p[t][i])
        for t in critical + others[:capacity - len(critical)]:
            need[t] -= 1
            taken[t].append(i)
    return taken


@pytest.mark.parametrize("N,E,k,iterations", [(12, 4, 1, 10), (12, 4, 2, 10), (10, 5, 3, 0), (7, 3, 2, 5), (16, 8, 2, 3)])
@pytest.mark.parametrize("skew", [0.0, 3.0])
def test_balanced_assignment_gives_every_expert_its_share(N, E, k, iterations, skew):
    """skew: every token prefers expert 0 by that much (top-k would overload it)."""
    g = torch.Generator().manual_seed(N * E + k)
    log_a = torch.randn(N, E, generator=g, dtype=F64)
    log_a[:, 0] += skew
    experts = balanced_assignment(log_a, k, iterations)
    assert experts.tolist() == naive_balanced(log_a.tolist(), k, iterations)
    load = experts.flatten().bincount(minlength=E)
    if N * k % E == 0:
        assert load.tolist() == [N * k // E] * E
    else:
        assert load.max() <= math.ceil(N * k / E) and load.sum() == N * k
    assert all(len(set(row)) == k for row in experts.tolist())


def test_balanced_router_agrees_with_token_choice_when_that_is_balanced():
    """Scores where each token's top-k is already balanced: the balanced assignment is token choice
    (overlap 1); skew them and training routing stays balanced while token choice does not."""
    E, N, k = 4, 16, 2
    m = make_moe(d=E, num_experts=E, top_k=k, expert_intermediate_size=3, router="balanced").double()
    with torch.no_grad():
        m.router.weight.copy_(torch.eye(E, dtype=F64))
    x = torch.zeros(N, E, dtype=F64)
    for t in range(N):
        x[t, t % E], x[t, (t + 1) % E] = 3.0, 2.0
    m.train()
    aux = AuxCollector()
    m(x, aux)
    routing = m.router(x)
    assert pairs(routing) == {(t, i) for t in range(N) for i in (t % E, (t + 1) % E)}
    assert aux.summary()["moe/token_choice_overlap"].item() == 1.0
    x[:, 0] += 5.0
    aux = AuxCollector()
    m(x, aux)
    assert aux.summary()["moe/imbalance"].item() == 1.0 and aux.summary()["moe/token_choice_overlap"].item() < 1
    m.eval()
    assert (m.router(x).expert.view(N, k) == 0).any(-1).all()  # evaluation: token choice, every token takes 0


def naive_group_limited(choice: list[float], k: int, G: int, M: int) -> set[int]:
    E = len(choice)
    size = E // G
    per_group = min(size, math.ceil(k / M))
    group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:per_group]) for g in range(G)]
    groups = sorted(range(G), key=lambda g: -group_score[g])[:M]
    allowed = [i for i in range(E) if i // size in groups]
    return set(sorted(allowed, key=lambda i: -choice[i])[:k])


@pytest.mark.parametrize("E,G,M,k", [(8, 4, 1, 2), (8, 4, 2, 3), (12, 3, 2, 4), (16, 8, 3, 6), (8, 2, 1, 4)])
def test_group_limited_routing_stays_within_M_groups(E, G, M, k):
    choice = torch.randn(200, E, generator=torch.Generator().manual_seed(E + G + M + k), dtype=F64)
    experts = token_choice(choice, k, G, M)
    assert [set(row) for row in experts.tolist()] == [naive_group_limited(row, k, G, M) for row in choice.tolist()]
    groups_used = [len({i // (E // G) for i in row}) for row in experts.tolist()]
    assert max(groups_used) <= M
    assert max(len({i // (E // G) for i in row}) for row in token_choice(choice, k).tolist()) > M  # unlimited


def test_group_limited_topk_layer_and_group_load():
    """Through the layer: every token's experts within M groups; per-group load = sum of its experts'."""
    m, x = scores_layer("topk", N=40, E=8, top_k=3, num_expert_groups=4, router_options=dict(max_groups_per_token=2))
    m.train()
    aux = AuxCollector()
    m(x, aux)
    experts = m.router(x).expert.view(40, 3)
    assert max(len({i // 2 for i in row}) for row in experts.tolist()) <= 2
    summary = aux.summary()
    load = summary["moe/layer1/load"]
    torch.testing.assert_close(summary["moe/layer1/group_load"], load.view(4, 2).sum(-1))
    assert summary["moe/layer1/group_imbalance"].item() == pytest.approx(4 * load.view(4, 2).sum(-1).max().item())


# ---- losses by hand -----------------------------------------------------------------------------------
LOGITS = [[[2.0, 0.5, -1.0, 0.0], [1.5, 1.0, 0.2, -0.3], [0.1, 0.3, 2.2, -2.0]],
          [[3.0, -1.0, 0.0, 0.4], [0.0, 0.0, 0.1, 0.9], [-0.5, 2.5, 0.3, 0.2]]]  # [B 2, T 3, E 4]


def identity_router_layer(k: int, **options) -> MoE:
    """A layer whose router logits equal its input (d = E = 4, W_r = I)."""
    m = make_moe(d=4, num_experts=4, top_k=k, expert_intermediate_size=3, **options).double()
    with torch.no_grad():
        m.router.weight.copy_(torch.eye(4, dtype=F64))
    return m


def softmax(row):
    e = [math.exp(v) for v in row]
    return [v / sum(e) for v in e]


@pytest.mark.parametrize("k", [1, 2])
def test_sequence_and_group_balance_losses_by_hand(k):
    """Top-1 per token: {0}, {0}, {2} | {0}, {3}, {1}; top-2 adds {1}, {1}, {1} | {3}, {2}, {2}."""
    m = identity_router_layer(k, num_expert_groups=2, sequence_balance_loss_coef=0.5, group_balance_loss_coef=0.25)
    aux = AuxCollector()
    m.train()
    m(torch.tensor(LOGITS, dtype=F64), aux)
    picks = [[[0], [0], [2]], [[0], [3], [1]]] if k == 1 else [[[0, 1], [0, 1], [2, 1]], [[0, 3], [3, 2], [1, 2]]]
    probs = [[softmax(row) for row in seq] for seq in LOGITS]
    per_row = []
    for seq_picks, seq_probs in zip(picks, probs):
        f = [sum(i in p for p in seq_picks) / (3 * k) for i in range(4)]
        P = [sum(p[i] for p in seq_probs) / 3 for i in range(4)]
        per_row.append(4 * sum(fi * pi for fi, pi in zip(f, P)))
    sequence = sum(per_row) / 2
    f = [sum(i in p for seq in picks for p in seq) / (6 * k) for i in range(4)]
    P = [sum(p[i] for seq in probs for p in seq) / 6 for i in range(4)]
    group = 2 * ((f[0] + f[1]) * (P[0] + P[1]) + (f[2] + f[3]) * (P[2] + P[3]))
    switch = 4 * sum(fi * pi for fi, pi in zip(f, P))
    value = {name: items[0][0].item() for name, items in aux.losses.items()}  # float64, as computed
    assert value["moe/sequence_balance_loss"] == pytest.approx(sequence, rel=1e-12)
    assert value["moe/group_balance_loss"] == pytest.approx(group, rel=1e-12)
    summary = aux.summary()  # logged in fp32, per layer too
    assert summary["moe/layer1/sequence_balance_loss"].item() == pytest.approx(sequence, rel=1e-6)
    assert sequence != pytest.approx(switch)  # not the batch-level loss
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for seq in LOGITS for row in seq) / 6
    expected = 1e-2 * switch + 1e-3 * z + 0.5 * sequence + 0.25 * group
    assert aux.total_loss().item() == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(summary["moe/layer1/group_load"], torch.tensor([f[0] + f[1], f[2] + f[3]], dtype=torch.float32))


def test_balance_losses_are_one_when_balanced_and_group_loss_sees_groups_only():
    """Cyclic preferences: every expert and every row balanced -> all three losses are 1. Then load
    moved between the experts of one group (0 takes 1's tokens): the expert-level loss rises, the
    group loss stays 1 (balanced groups give G sum_g P'_g / G = 1 whatever P)."""
    m = identity_router_layer(1, num_expert_groups=2)
    x = torch.zeros(2, 4, 4, dtype=F64)
    for b in range(2):
        for t in range(4):
            x[b, t, t] = 2.0
    aux = AuxCollector()
    m(x, aux)
    for name in ("balance_loss", "sequence_balance_loss", "group_balance_loss"):
        assert aux.losses[f"moe/{name}"][0][0].item() == pytest.approx(1.0, rel=1e-12), name
    x = torch.zeros(2, 4, 4, dtype=F64)
    for b in range(2):
        for t, i in enumerate([0, 0, 2, 3]):
            x[b, t, i] = 2.0
    aux = AuxCollector()
    m(x, aux)
    assert aux.losses["moe/balance_loss"][0][0].item() > 1.05
    assert aux.losses["moe/group_balance_loss"][0][0].item() == pytest.approx(1.0, rel=1e-12)


# ---- gradients --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("router", ROUTERS.names())  # every registered router
def test_gradients_reach_exactly_the_routers_parameters(router):
    """Finite differences through the whole layer (training routing) in float64; then which
    parameters get a gradient: every parameter of the router (hash has none)."""
    m, x = scores_layer(router, N=9, E=4, top_k=2, num_shared_experts=1)
    m.train()
    x.requires_grad_()
    params = [p for _, p in m.named_parameters()]
    torch.autograd.gradcheck(lambda x, *p: m(x, None, torch.arange(9)), (x, *params), fast_mode=True)
    m.zero_grad()
    m(x, None, torch.arange(9)).square().sum().backward()
    with_grad = sorted(n for n, p in m.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0)
    expected = ["down_proj", "gate_up_proj", "shared.down_proj.weight", "shared.gate_proj.weight", "shared.up_proj.weight"]
    assert with_grad == sorted(expected + [f"router.{name}" for name, _ in m.router.named_parameters()])
    assert (router == "hash") == (not list(m.router.parameters()))


# ---- decoding and export -----------------------------------------------------------------------------------
def tiny_router_lm(router: str, **options) -> DecoderLM:
    torch.manual_seed(0)
    config = LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                      ffn=["moe", "dense"], ffn_options={"moe": dict(router=router, num_experts=4, top_k=2,
                                                                     expert_intermediate_size=16, **options)})
    return DecoderLM(config)


@pytest.mark.parametrize("router", ROUTERS.names())  # every registered router
def test_decode_and_export_for_every_router(router, tmp_path):
    """Evaluation routing is per token for every router: prefill + one-token steps with the cache give
    the full forward's logits, generate with the cache equals generate without; save_pretrained /
    from_pretrained gives the same logits and config.json names the router."""
    model = tiny_router_lm(router).eval()
    data = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    full = model(data).logits
    out = model(data[:, :8], use_cache=True)
    for t in range(8, 12):
        out = model(data[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
        torch.testing.assert_close(out.logits[:, -1], full[:, t], rtol=1e-5, atol=1e-5)
    cached = model.generate(data[:, :5], max_new_tokens=6, do_sample=False)
    uncached = model.generate(data[:, :5], max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["ffn_options"]["moe"]["router"] == router
    loaded = DecoderLM.from_pretrained(tmp_path).eval()
    assert loaded.layers[0].ffn.router.__class__ is model.layers[0].ffn.router.__class__
    torch.testing.assert_close(loaded(data).logits, full, rtol=0, atol=0)


@pytest.mark.parametrize("router", ["expert_choice", "balanced"])
def test_evaluation_with_training_routing_differs_from_token_choice(router):
    """The two evaluation routings of a non-causal router: token choice (default) and, under
    its evaluation variant batch_routing, the training routing over the batch, which equals the training forward."""
    model = tiny_router_lm(router, router_options=dict(capacity_factor=0.5)) if router == "expert_choice" else tiny_router_lm(router)
    data = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    train_logits = model.train()(data).logits
    model.eval()
    token_choice_logits = model(data).logits
    with eval_variant(model, "batch_routing"):
        torch.testing.assert_close(model(data).logits, train_logits, rtol=0, atol=0)
    assert not torch.allclose(token_choice_logits, train_logits)
    assert eval_variant_names(model) == ["batch_routing"] and eval_variant_names(tiny_router_lm("topk")) == []


def test_flops_count_the_experts_each_router_runs():
    d, f, E, k = 32, 16, 4, 2
    topk, ec, hashed = (tiny_router_lm(r, **o).layers[0].ffn for r, o in
                        [("topk", {}), ("expert_choice", {"router_options": {"capacity_factor": 1.5}}), ("hash", {})])
    assert topk.flops_per_token() == 2 * d * E + k * 2 * 3 * d * f
    assert ec.flops_per_token() == 2 * d * E + 1.5 * k * 2 * 3 * d * f
    assert hashed.flops_per_token() == k * 2 * 3 * d * f  # no router


# ---- bad options: one line naming the key, the value and what is valid ----------------------------------------
@pytest.mark.parametrize("options,message", [
    (dict(router="nope"), f"unknown moe router 'nope'; valid: {', '.join(ROUTERS.names())}"),  # the registry's, sorted
    (dict(router="reinforce", router_options=dict(score_func="sigmoid")),
     "unknown reinforce router option(s) ['score_func']; valid: route_scale, norm_topk_prob, loss_coef, entropy_coef, "
     "baseline, baseline_decay, policy, temperature_start, temperature_end, temperature_steps, weight_decay, z_loss, "
     "policy_grad_to_input"),
    (dict(router="reinforce", router_options=dict(baseline="critic")),
     "unknown reinforce router baseline 'critic'; valid: token_table, self_critical, mean, value"),
    (dict(router="reinforce", router_options=dict(baseline_decay=1.0)), "reinforce router baseline_decay=1.0; valid: 0 <= decay < 1"),
    (dict(router="reinforce", router_options=dict(policy="unordered")),
     "unknown reinforce router policy 'unordered'; valid: ordered, set"),
    (dict(router="reinforce", router_options=dict(temperature_steps=0)),
     "reinforce router temperature_steps=0; valid: > 0 to anneal temperature_start=1.0 to temperature_end=0.25"),
    (dict(router="reinforce", router_options=dict(temperature_start=0)), "reinforce router temperature_start=0; valid: a number > 0"),
    (dict(router_options=dict(loss_coef=0.1)), "unknown topk router option(s) ['loss_coef']; valid: route_scale, "
                                               "norm_topk_prob, score_func, max_groups_per_token"),
    (dict(router="hash", router_options=dict(capacity_factor=2.0)), "unknown hash router option(s) ['capacity_factor']; "
                                                                    "valid: route_scale, norm_topk_prob"),
    (dict(router_options="capacity_factor=2"), "moe router_options='capacity_factor=2'; valid: a mapping"),
    (dict(expert_choice_capacity_factor=2.0), "unknown moe option(s) ['expert_choice_capacity_factor']; valid: router, "
                                              "router_options, num_experts"),  # config.json of the flat options
    (dict(router="hash", aux_free_bias=True), "moe aux_free_bias=True; valid: False with router=hash"),
    (dict(router="expert_choice", aux_free_bias=True), "moe aux_free_bias=True; valid: False with router=expert_choice"),
    (dict(router="expert_choice", router_options=dict(capacity_factor=0)), "expert_choice router capacity_factor=0; valid: a number > 0"),
    (dict(router="balanced", router_options=dict(sinkhorn_iterations=-1)), "balanced router sinkhorn_iterations=-1; valid: an integer >= 0"),
    (dict(num_expert_groups=3), "moe num_expert_groups=3; valid: a divisor of num_experts=8"),
    (dict(num_expert_groups=4, router_options=dict(max_groups_per_token=5)), "topk router max_groups_per_token=5; valid: 1..num_expert_groups=4"),
    (dict(num_expert_groups=8, router="balanced", router_options=dict(max_groups_per_token=1)),
     "balanced router max_groups_per_token=1; valid: 2..num_expert_groups=8"),
])
def test_bad_router_options_are_one_line(options, message):
    with pytest.raises(ValueError) as e:
        make_moe(**options)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_hash_without_token_ids_is_one_line():
    m = make_moe(router="hash")
    with pytest.raises(ValueError, match="router=hash needs the input token ids"):
        m(torch.randn(4, 12))


def test_compare_shows_the_router_and_its_metrics():
    """scripts/compare.py's row of a MoE run (analysis.summary): the router in the ffn column and the routing metrics
    the comparison table needs, from the last log that has them."""
    from analysis.runs import Run
    from analysis.summary import summarize_run

    rows = [{"step": 10, "moe/imbalance": 1.3, "moe/dead_experts": 1.0, "moe/unrouted_frac": 0.2,
             "moe/token_choice_overlap": 0.7},
            {"step": 20, "val/loss": 2.0, "val/bpb": 1.5, "val/batch_routing/bpb": 1.4, "moe/imbalance": 1.0,
             "moe/dead_experts": 0.0, "moe/unrouted_frac": 0.1, "moe/token_choice_overlap": 0.8}]
    config = {"mixer": {"name": "softmax"}, "ffn": {"name": "moe", "options": {"router": "expert_choice"}},
              "model": {"hidden_size": 32}}
    s = summarize_run(Run("ec", "here", config, rows, params={"total": 1, "active": 1}))
    assert (s["ffn"], s["val_bpb"], s["val_bpb_batch_routing"]) == ("moe:expert_choice", 1.5, 1.4)
    assert (s["moe_imbalance"], s["moe_dead_experts"], s["moe_unrouted_frac"], s["moe_token_choice_overlap"]) == (1.0, 0.0, 0.1, 0.8)
    config["ffn"]["options"]["router"] = "topk"
    assert summarize_run(Run("tk", "here", config, rows, params={"total": 1, "active": 1}))["ffn"] == "moe"


def test_sweep_stops_in_one_line_at_a_job_whose_router_rejects_an_option(capsys):
    """Before anything runs, scripts/sweep.py builds each job's model: a grid that crosses a router
    with an option it does not take names the job, the key, the value and what is valid."""
    from scripts import sweep

    with pytest.raises(SystemExit) as e:
        sweep.main(["ffn=moe", "ffn.options.router=topk,hash", "ffn.options.aux_free_bias=true", "--dry-run"])
    assert e.value.code == "error: job 1_hash: moe aux_free_bias=True; valid: False with router=hash"


@pytest.mark.slow
def test_training_and_eval_report_the_val_loss_both_ways_for_expert_choice(tmp_path, data_cache):
    """A non-causal router: training's evaluation and eval.py's give val/ (token choice) and
    val/batch_routing/ (expert choice over each evaluation batch) on the same sequences; with capacity
    factor 0.5 expert choice leaves tokens without a routed expert, so the two differ (a little, after 4
steps from an init whose experts barely write into the residual stream)."""
    from test_contract_suites import eval_config

    from conftest import train_here
    from eval import evaluate_checkpoint
    from runs.metrics import read_metrics

    run = tmp_path / "ec"
    train_here(run, "ffn=moe", "ffn.options.router=expert_choice", "ffn.options.router_options.capacity_factor=0.5",
              "trainer.max_steps=4", "trainer.sample_tokens=0", cache=data_cache)
    evals = [r for r in read_metrics(run) if "val/loss" in r]
    assert len(evals) == 1 and abs(evals[0]["val/batch_routing/bpb"] - evals[0]["val/bpb"]) > 1e-5
    train_rows = [r for r in read_metrics(run) if "moe/unrouted_frac" in r]
    assert train_rows and all(r["moe/unrouted_frac"] > 0 for r in train_rows)
    evaluate_checkpoint(eval_config([f"checkpoint={run}", "batches=2", "sample_tokens=0", "wandb=false",
                                     f"out_dir={tmp_path / 'eval'}"]))
    scores = json.loads((tmp_path / "eval" / "eval.json").read_text())["scores"]
    assert abs(scores["val/batch_routing/loss"] - scores["val/loss"]) > 1e-5


# A config.json's ffn_options["moe"] as saved before routers declared their own options (commit b8c4943:
# `python train.py ffn=moe ffn.options.router=reinforce ffn.options.reinforce_loss_coef=0.5 ffn.options.norm_topk_prob=false`).
FLAT_MOE_OPTIONS = {
    "reinforce_loss_coef": 0.5, "reinforce_entropy_coef": 0.0, "reinforce_baseline": "mean", "reinforce_baseline_decay": 0.99,
    "balanced_sinkhorn_iterations": 10, "expert_choice_capacity_factor": 1.0, "router": "reinforce", "num_experts": 8,
    "top_k": 2, "expert_intermediate_size": None, "num_shared_experts": 0, "score_func": "softmax", "norm_topk_prob": False,
    "route_scale": 1.0, "balance_loss_coef": 0.01, "sequence_balance_loss_coef": 0.0, "group_balance_loss_coef": 0.0,
    "z_loss_coef": 0.001, "aux_free_bias": False, "bias_update_rate": 0.001, "capacity_factor": None, "num_expert_groups": 1,
    "max_groups_per_token": None}


def test_a_config_saved_with_flat_router_options_loads():
    """The chosen router's options land in its Options under their new names; another router's, at their defaults,
    are dropped; one that is not at its default, or a name no router declares, is a one-line error."""
    def router(options):
        config = LMConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                          ffn="moe", ffn_options={"moe": options})
        return DecoderLM(config).layers[0].ffn.router

    options = router(FLAT_MOE_OPTIONS).options
    assert (options.loss_coef, options.norm_topk_prob, options.baseline_decay) == (0.5, False, 0.99)
    with pytest.raises(ValueError, match=r"unknown moe option\(s\) \['expert_choice_capacity_factor'\]"):
        router({**FLAT_MOE_OPTIONS, "expert_choice_capacity_factor": 2.0})
    with pytest.raises(ValueError, match=r"unknown moe option\(s\) \['nope'\]"):
        router({**FLAT_MOE_OPTIONS, "nope": 1})
