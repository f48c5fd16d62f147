"""router=reinforce (model/ffn/routers/reinforce.py) in numbers: the REINFORCE gradient against a hand
computation (k = 1 and Plackett-Luce k = 2, at two temperatures), its sign and size on a rigged case, the
policy terms' gradient to the router input (0 unless policy_grad_to_input; G W with it),
exactly 0 when every reward equals the baseline, the set probability against the sum over orders,
advantages standardised, greedy evaluation equal to top-k on the same logits, sampling frequencies
against the tempered policy on 10^5 draws (chi-square), the temperature schedule, sampling seeded per
token (layout-independent, new each step), the token table and self-critical baselines, the router
weight out of weight decay and the z-loss unless asked, the token losses the model hands over through
the aux channel (reward -CE per token) and the telemetry. DDP, EP, decoding and export: with the other
routers in tests/test_moe_routers_ddp.py, tests/test_expert_parallel.py and tests/test_moe_routers.py."""
import itertools

import pytest
import torch

from model import DecoderLM, LMConfig
from model.ffn.moe import MoEOptions
from model.ffn.routers.reinforce import Reinforce, context_keys, sample_log_prob, set_log_prob, standardized
from model.ffn.routers.topk import TopK
from model.layers import AuxCollector

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")


def router(E=4, k=1, d=6, seed=0, layer_idx=0, vocab=100, **options) -> Reinforce:
    torch.manual_seed(seed)
    moe = MoEOptions(router="reinforce", num_experts=E, top_k=k, router_options=options)
    r = Reinforce(LMConfig(hidden_size=d, vocab_size=vocab), layer_idx, moe).double()
    with torch.no_grad():
        r.weight.normal_(0, 1)
    return r.train()


def reinforce_losses(r: Reinforce, x, ids, token_loss, labelled=None, bias=None) -> AuxCollector:
    """A training forward with the aux channel, then the token losses the model would hand over."""
    aux = AuxCollector()
    r(x, ids, bias, aux)
    aux.give_token_loss(lambda: token_loss, torch.ones(len(x), dtype=torch.bool) if labelled is None else labelled)
    return aux


def standardized_by_hand(a: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
    kept = a[labelled]
    return (a - kept.mean()) / (kept.std(correction=0) + 1e-8)


@pytest.mark.parametrize("k,temperature", [(1, 1.0), (2, 1.0), (2, 2.0)])
def test_reinforce_gradient_by_hand(k, temperature):
    """L = coef mean_t -A_t log pi(e_t) over the labelled tokens, A the standardised r_t - b (b = the
    forward's mean reward); pi = softmax(z / tau), and d log pi / dz for the ordered draw:
    (sum_j onehot(e_j) - softmax(z / tau without e_1..e_{j-1})) / tau."""
    N, E, d = 7, 4, 6
    r = router(E, k, d, loss_coef=0.3, baseline="mean", temperature_start=temperature, temperature_end=temperature)
    x = torch.randn(N, d, generator=torch.Generator().manual_seed(1), dtype=F64)
    ids = torch.arange(N).view(1, N)
    experts = r(x, ids).expert.view(N, k)
    reward = torch.randn(N, generator=torch.Generator().manual_seed(2), dtype=F64) - 2
    labelled = torch.ones(N, dtype=torch.bool)
    labelled[3] = False
    aux = reinforce_losses(r, x, ids, -reward, labelled)
    (value, coef), = aux.losses["moe/reinforce_loss"]
    assert coef == 0.3
    (coef * value).backward()

    z = x @ r.weight.detach().t() / temperature
    p = z.softmax(-1)
    # the draw's probability, Plackett-Luce: p_e1 [p_e2 / (1 - p_e1)]
    want_logp = p.gather(1, experts[:, :1]).log()[:, 0]
    if k == 2:
        p1 = p.gather(1, experts[:, :1])[:, 0]
        want_logp = want_logp + (p.gather(1, experts[:, 1:])[:, 0] / (1 - p1)).log()
    advantage = standardized_by_hand(reward, labelled) * labelled
    torch.testing.assert_close(value.detach(), -(advantage * want_logp).sum() / labelled.sum(), rtol=1e-12, atol=1e-12)
    dz = torch.zeros(N, E, dtype=F64)
    removed = torch.zeros(N, E, dtype=torch.bool)
    for j in range(k):
        dz += torch.nn.functional.one_hot(experts[:, j], E) - z.masked_fill(removed, float("-inf")).softmax(-1)
        removed[torch.arange(N), experts[:, j]] = True
    dz = -0.3 * advantage[:, None] * dz / labelled.sum() / temperature
    torch.testing.assert_close(r.weight.grad, dz.t() @ x, rtol=1e-12, atol=1e-12)


def test_the_score_function_gradient_on_a_rigged_case():
    """Every token has the same logits z; the tokens that sampled expert 2 get reward 1, the rest 0. Standardised,
    A = (r - q) / sqrt(q (1 - q)) (q: the share that sampled 2), so with the default coef 1 the gradient of L_pg
    on z, summed over the tokens, is -sqrt(q (1 - q)) at expert 2 (a descent step raises its logit) and
    n_i q / (N sqrt(q (1 - q))) at each other expert i (n_i: the tokens that sampled i)."""
    N, E = 400, 4
    r = router(E, k=1, d=E, baseline="mean", policy_grad_to_input=True)  # the gradient on z = x
    with torch.no_grad():
        r.weight.copy_(torch.eye(E, dtype=F64))  # logits = x
    z = torch.tensor([0.3, -0.2, 0.1, 0.0], dtype=F64)
    ids = torch.arange(N).view(N, 1)
    experts = r(z.expand(N, E), ids).expert
    reward = (experts == 2).double()
    q = reward.mean().item()
    assert 0.1 < q < 0.5
    x = z.expand(N, E).clone().requires_grad_()
    (value, coef), = reinforce_losses(r, x, ids, -reward).losses["moe/reinforce_loss"]
    assert coef == 1.0
    (grad,) = torch.autograd.grad(value, x)
    spread = (q * (1 - q)) ** 0.5
    want = torch.bincount(experts, minlength=E).double() * q / (N * spread)
    want[2] = -spread
    torch.testing.assert_close(grad.sum(0), want, rtol=1e-6, atol=1e-9)
    assert grad.sum(0)[2] < 0 and (grad.sum(0)[[0, 1, 3]] > 0).all()


@pytest.mark.parametrize("policy", ["ordered", "set"])
def test_the_policy_terms_reach_the_router_input_only_if_asked(policy):
    """L_pg + L_ent as a function of the logits z = x W^T has gradient G [N, E] on z (by autograd on a
    recomputation from z). policy_grad_to_input=true: dL/dx = G W and dL/dW = G^T x; false (the default):
    dL/dx = 0 and dL/dW = G^T x the same, while the gates still carry the LM loss to x."""
    N, E, d, k = 9, 4, 6, 2
    x0 = torch.randn(N, d, generator=torch.Generator().manual_seed(3), dtype=F64)
    ids = torch.arange(N).view(1, N)
    reward = torch.randn(N, generator=torch.Generator().manual_seed(4), dtype=F64)
    grads = {}
    for to_input in (True, False):
        options = dict(baseline="mean", entropy_coef=0.2, policy=policy, temperature_start=1.5, temperature_end=1.5)
        r = router(E, k, d, **options, **({"policy_grad_to_input": True} if to_input else {}))
        assert r.options.policy_grad_to_input is to_input  # false by default
        x = x0.clone().requires_grad_()
        aux = AuxCollector()
        routing = r(x, ids, None, aux)
        aux.give_token_loss(lambda: -reward, torch.ones(N, dtype=torch.bool))
        loss = sum(value * coef for name in ("moe/reinforce_loss", "moe/policy_entropy")
                   for value, coef in aux.losses[name])
        grads[to_input] = torch.autograd.grad(loss, [x, r.weight], allow_unused=True, retain_graph=True)
        (gate_grad,) = torch.autograd.grad((routing.gate * torch.arange(N * k)).sum(), x)  # gates sum to 1 per token
        assert gate_grad.abs().max() > 1e-3  # the gate term reaches the trunk either way

    z = (x0 @ r.weight.detach().t()).requires_grad_()
    log_policy = (z / 1.5).log_softmax(-1)
    experts = routing.expert.view(N, k)
    log_prob = set_log_prob(log_policy, experts) if policy == "set" else sample_log_prob(log_policy, experts)
    entropy = -(log_policy.exp() * log_policy).sum(-1)
    advantage = standardized_by_hand(reward, torch.ones(N, dtype=torch.bool))
    (G,) = torch.autograd.grad(-(advantage * log_prob).mean() - 0.2 * entropy.mean(), z)
    assert G.abs().max() > 1e-2
    dx_on, dw_on = grads[True]
    dx_off, dw_off = grads[False]
    torch.testing.assert_close(dx_on, G @ r.weight.detach(), rtol=1e-10, atol=1e-12)
    assert dx_on.abs().max() > 1e-2
    assert dx_off is None  # no path from L_pg or L_ent to x
    torch.testing.assert_close(dw_on, G.t() @ x0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw_off, G.t() @ x0, rtol=1e-10, atol=1e-12)


def test_no_policy_gradient_when_every_reward_is_the_baseline():
    r = router(E=4, k=2)
    x = torch.randn(9, 6, dtype=F64)
    aux = reinforce_losses(r, x, torch.arange(9).view(1, 9), torch.full((9,), 3.25, dtype=F64))
    (value, coef), = aux.losses["moe/reinforce_loss"]
    (value * coef).backward()
    assert r.weight.grad is not None and torch.equal(r.weight.grad, torch.zeros_like(r.weight))


def test_advantages_are_standardised_over_the_labelled_tokens():
    a = torch.tensor([3.0, -1.0, 100.0, 0.5, 2.0], dtype=F64)
    labelled = torch.tensor([True, True, False, True, True])
    s = standardized(a, labelled)
    assert s[labelled].mean().item() == pytest.approx(0, abs=1e-12)
    assert s[labelled].std(correction=0).item() == pytest.approx(1, rel=1e-7)  # 1 up to the floor 1e-8
    torch.testing.assert_close(s, standardized_by_hand(a, labelled), rtol=1e-12, atol=1e-12)
    assert torch.equal(standardized(torch.full((4,), 2.5, dtype=F64), torch.ones(4, dtype=torch.bool)), torch.zeros(4, dtype=F64))


def test_set_probability_is_the_sum_over_orders():
    """k = 2: p_a p_b / (1 - p_a) + p_b p_a / (1 - p_b); k = 3: the six Plackett-Luce orders summed."""
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.3], [1.0, 1.0, -0.5, 0.0]], dtype=F64)
    p = logits.softmax(-1)
    pair = torch.tensor([[2, 0], [1, 3]])
    a, b = p.gather(1, pair[:, :1])[:, 0], p.gather(1, pair[:, 1:])[:, 0]
    torch.testing.assert_close(set_log_prob(logits, pair).exp(), a * b / (1 - a) + b * a / (1 - b), rtol=1e-13, atol=0)
    triple = torch.tensor([[2, 0, 3], [3, 1, 0]])
    orders = sum(sample_log_prob(logits, triple[:, list(o)]).exp() for o in itertools.permutations(range(3)))
    torch.testing.assert_close(set_log_prob(logits.log_softmax(-1), triple).exp(), orders, rtol=1e-13, atol=0)
    # summed over every set of 2, the probabilities make 1
    total = sum(set_log_prob(logits, torch.tensor([list(c)] * 2)).exp() for c in itertools.combinations(range(4), 2))
    torch.testing.assert_close(total, torch.ones(2, dtype=F64), rtol=1e-13, atol=0)


def test_policy_set_trains_the_set_probability():
    N, d = 8, 6
    r = router(E=4, k=2, d=d, policy="set", baseline="mean")
    x = torch.randn(N, d, generator=torch.Generator().manual_seed(5), dtype=F64)
    ids = torch.arange(N).view(1, N)
    experts = r(x, ids).expert.view(N, 2)
    reward = torch.randn(N, generator=torch.Generator().manual_seed(6), dtype=F64)
    (value, _), = reinforce_losses(r, x, ids, -reward).losses["moe/reinforce_loss"]
    want = -(standardized_by_hand(reward, torch.ones(N, dtype=torch.bool)) * set_log_prob(x @ r.weight.t(), experts)).mean()
    torch.testing.assert_close(value, want, rtol=1e-12, atol=1e-12)


def test_greedy_evaluation_is_topk_on_the_same_logits():
    r = router(E=8, k=2, d=6)
    top = TopK(LMConfig(hidden_size=6), 0, MoEOptions(num_experts=8, top_k=2)).double()
    top.weight.data.copy_(r.weight.data)
    x = torch.randn(50, 6, dtype=F64)
    r.eval()
    aux = AuxCollector()
    a, b, c = r(x, None, None, aux), r(x), top(x)
    assert torch.equal(a.expert, b.expert) and torch.equal(a.expert, c.expert)
    torch.testing.assert_close(a.gate, c.gate, rtol=0, atol=0)
    assert not aux.token_loss_consumers  # greedy: no policy to train
    r.train()
    sampled = r(x, torch.arange(50).view(1, 50))
    assert not torch.equal(sampled.expert, a.expert)  # training samples (here: 50 tokens, near-uniform-ish policy)
    # greedy agreement per (token, expert) pair: the share of greedy's 2 N pairs the draw also made
    drawn, greedy = sampled.expert.view(50, 2), a.expert.view(50, 2)
    shared = sum(len(set(s.tolist()) & set(g.tolist())) for s, g in zip(drawn, greedy))
    assert 0 < shared < 100 and sampled.token_choice_overlap.item() == pytest.approx(shared / 100, rel=1e-6)


@pytest.mark.parametrize("k,temperature", [(1, 1.0), (2, 1.0), (1, 0.5)])
def test_sampling_frequencies_follow_the_policy(k, temperature):
    """10^5 tokens with the same logits and different contexts: the counts of each (ordered) draw
    against N pi (k = 1) or N p_a p_b / (1 - p_a) (k = 2), pi = softmax(z / tau), chi-square below its
    0.1% critical value."""
    E, N = 4, 100_000
    r = router(E, k, d=E, temperature_start=temperature, temperature_end=temperature)
    with torch.no_grad():
        r.weight.copy_(torch.eye(E, dtype=F64))
    logits = torch.tensor([1.0, 0.2, -0.5, 0.7], dtype=F64)
    routing = r(logits.expand(N, E), torch.arange(N).view(N, 1))
    experts = routing.expert.view(N, k)
    p = (logits / temperature).softmax(-1)
    if k == 1:
        observed = torch.bincount(experts[:, 0], minlength=E).double()
        expected = N * p
        critical = 16.27  # chi-square, 3 degrees of freedom, p = 0.001
    else:
        observed = torch.bincount(experts[:, 0] * E + experts[:, 1], minlength=E * E).double()
        expected = (N * p[:, None] * p[None, :] / (1 - p[:, None])).flatten()
        off = ~torch.eye(E, dtype=torch.bool).flatten()
        assert observed[~off].sum() == 0  # k distinct experts
        observed, expected = observed[off], expected[off]
        critical = 31.26  # 11 degrees of freedom
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < critical, (chi2, observed, expected)


def test_sampling_is_seeded_per_token_and_new_each_step():
    """A token's draw depends on its row's ids up to it, the layer and the step: the same rows split
    into other batches draw the same experts; the next step or another layer draws anew."""
    r = router(E=8, k=2, d=6)
    ids = torch.randint(0, 100, (4, 10), generator=torch.Generator().manual_seed(3))
    x = torch.randn(40, 6, dtype=F64)
    whole = r(x, ids).expert.view(4, 10, 2)
    halves = torch.cat([r(x[:20], ids[:2]).expert, r(x[20:], ids[2:]).expert]).view(4, 10, 2)
    assert torch.equal(whole, halves)
    assert torch.equal(context_keys(ids).view(4, 10)[2:], context_keys(ids[2:]).view(2, 10))
    r.steps += 1
    assert not torch.equal(r(x, ids).expert.view(4, 10, 2), whole)
    other_layer = router(E=8, k=2, d=6, layer_idx=1)  # the same weights
    assert torch.equal(other_layer.weight, r.weight) and not torch.equal(other_layer(x, ids).expert.view(4, 10, 2), whole)


def test_the_temperature_anneals_geometrically():
    """tau(s) = start (end / start)^min(s / steps, 1): 2 -> 0.5 over 4 steps; the step is the router's count of
    optimizer steps, which after_optimizer_step moves on after a training forward."""
    r = router(E=4, k=1, temperature_start=2.0, temperature_end=0.5, temperature_steps=4)
    got = []
    for _ in range(7):
        got.append(r.temperature().item())
        reinforce_losses(r, torch.randn(3, 6, dtype=F64), torch.arange(3).view(1, 3), torch.zeros(3, dtype=F64))
        r.after_optimizer_step()
    assert got == pytest.approx([2.0, 2.0 * 0.25 ** 0.25, 1.0, 2.0 * 0.25 ** 0.75, 0.5, 0.5, 0.5], rel=1e-12)
    r.after_optimizer_step()  # no training forward since the last step: the count stays
    assert r.steps.item() == 7
    default = router(E=4, k=1)  # 1 -> 0.25 over 120 steps
    assert default.temperature().item() == 1.0
    default.steps.fill_(60)
    assert default.temperature().item() == pytest.approx(0.5, rel=1e-12)
    default.steps.fill_(500)
    assert default.temperature().item() == 0.25


def test_the_token_table_baseline():
    """Per input id, the bias-corrected moving average of the mean reward of its labelled tokens in each
    optimizer step (all of the step's forwards); an id without an update yet: the forward's mean reward."""
    r = router(E=4, k=1, vocab=10, baseline="token_table", baseline_decay=0.5)
    x = torch.randn(5, 6, dtype=F64)
    ids = torch.tensor([[3, 3, 5, 7, 3]])
    labelled = torch.tensor([True, True, True, False, True])

    def baseline_of_a_forward(reward, forward_ids=ids):
        aux = reinforce_losses(r, x, forward_ids, -torch.tensor(reward, dtype=F64), labelled)
        return aux.metrics["moe/baseline"][0].item()

    # no update yet: every token's baseline is the forward's mean reward over the labelled tokens
    assert baseline_of_a_forward([1.0, 2.0, 4.0, 100.0, 3.0]) == pytest.approx(2.5)
    baseline_of_a_forward([3.0, 3.0, 2.5, 50.0, 3.0], torch.tensor([[3, 3, 3, 7, 3]]))  # a second micro-batch
    r.after_optimizer_step()
    # id 3: rewards 1, 2, 3, then 3, 3, 2.5, 3 (of the second micro-batch): mean 2.5; id 5: 4.0; id 7 unlabelled
    assert r.table_updates.tolist() == [0, 0, 0, 1, 0, 1, 0, 0, 0, 0]
    torch.testing.assert_close(r.reward_table[[3, 5, 7]], torch.tensor([0.5 * 2.5, 0.5 * 4.0, 0.0], dtype=F64))
    # bias-corrected after one update: exactly each id's mean; id 7 unseen: the forward's mean (of the labelled)
    base = r.baseline(torch.zeros(5, dtype=F64), torch.tensor(-9.0, dtype=F64), None,
                      type("P", (), {"token_ids": ids.flatten()})())
    torch.testing.assert_close(base, torch.tensor([2.5, 2.5, 4.0, -9.0, 2.5], dtype=F64))
    baseline_of_a_forward([1.0, 1.0, 6.0, 0.0, 1.0])
    r.after_optimizer_step()
    m3, m5 = 0.5 * 0.5 * 2.5 + 0.5 * 1.0, 0.5 * 0.5 * 4.0 + 0.5 * 6.0
    torch.testing.assert_close(r.reward_table[[3, 5]], torch.tensor([m3, m5], dtype=F64))
    assert r.table_updates[[3, 5, 7]].tolist() == [2, 2, 0]
    base = r.baseline(torch.zeros(5, dtype=F64), torch.tensor(0.0, dtype=F64), None,
                      type("P", (), {"token_ids": ids.flatten()})())
    torch.testing.assert_close(base[[0, 2]], torch.tensor([m3 / 0.75, m5 / 0.75], dtype=F64))


def tiny_lm(**options) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=64, ffn="moe",
                              ffn_options={"moe": dict(router="reinforce", num_experts=4, top_k=2,
                                                       expert_intermediate_size=16, **options)}))


@pytest.mark.parametrize("baseline,policy", [("token_table", "ordered"), ("self_critical", "set"), ("mean", "ordered"),
                                             ("value", "ordered")])
def test_the_model_hands_each_router_minus_ce_and_logs_the_policy(baseline, policy):
    """The reward of each router is the token's own -CE: its mean over the labelled tokens equals
    -lm_loss; the self-critical baseline is -CE of the evaluation forward (greedy routing), the model left
    training; the policy's telemetry is logged per layer and averaged; the value head (baseline=value)
    learns from its own loss only, and takes the router's input detached."""
    model = tiny_lm(router_options=dict(baseline=baseline, policy=policy, entropy_coef=0.01)).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    out = model(ids, labels=ids)
    m = out.aux_metrics
    assert model.training and model.layers[1].ffn.router.training
    assert m["moe/reward"].item() == pytest.approx(-out.lm_loss.item(), rel=1e-6)
    if baseline == "self_critical":
        greedy_loss = model.eval()(ids, labels=ids).lm_loss.item()
        model.train()
        assert m["moe/baseline"].item() == pytest.approx(-greedy_loss, rel=1e-6)
        assert greedy_loss != pytest.approx(out.lm_loss.item(), rel=1e-6)  # sampling routes otherwise
    for name in ("reward", "baseline", "advantage_var", "policy_entropy", "resampled_frac", "temperature",
                 "token_choice_overlap"):
        assert f"moe/layer0/{name}" in m and f"moe/layer1/{name}" in m and f"moe/{name}" in m
    # no bias: the router's entropy, here over the labelled tokens only (not the rows' last)
    assert m["moe/policy_entropy"].item() == pytest.approx(m["moe/router_entropy"].item(), rel=1e-3)
    assert 0 < m["moe/resampled_frac"] <= 1 and 0 < m["moe/token_choice_overlap"] < 1
    out.loss.backward()
    router = model.layers[0].ffn.router
    assert router.weight.grad.abs().sum() > 0
    if baseline == "value":
        assert router.value.grad.abs().sum() > 0 and "moe/reinforce_value_loss" in m
        value_only = tiny_lm(router_options=dict(baseline="value")).train()
        out = value_only(ids, labels=ids)
        value_only.zero_grad()
        out.aux_loss.backward()  # only the aux losses: the value loss must not reach the embeddings
        assert value_only.layers[0].ffn.router.value.grad.abs().sum() > 0
    eval_out = model.eval()(ids, labels=ids)
    assert "moe/reward" not in eval_out.aux_metrics  # greedy: no policy, no reward


def test_aux_free_bias_shifts_the_policy():
    """The aux-free bias is a logit shift of the policy: greedy = topk(z + b), and log pi is the
    biased softmax's (the distribution sampled)."""
    r = router(E=4, k=1, baseline="mean")
    x = torch.randn(30, 6, dtype=F64)
    ids = torch.arange(30).view(1, 30)
    bias = torch.tensor([0.0, 0.0, 0.0, 50.0], dtype=F64)
    r.eval()
    assert (r(x, None, bias).expert == 3).all()
    r.train()
    assert (r(x, ids, bias).expert == 3).all()
    reward = torch.randn(30, generator=torch.Generator().manual_seed(7), dtype=F64)
    aux = reinforce_losses(r, x, ids, -reward, bias=bias)
    (value, _), = aux.losses["moe/reinforce_loss"]
    advantage = standardized_by_hand(reward, torch.ones(30, dtype=torch.bool))
    torch.testing.assert_close(value, -(advantage * (x @ r.weight.t() + bias).log_softmax(-1)[:, 3]).mean())


def test_the_router_weight_takes_no_weight_decay_and_no_z_loss_unless_asked():
    """By default the optimizer puts the router weight in a group at weight decay 0 (Muon's with the other
    matrices, or AdamW's), and the MoE's z-loss is logged but not weighed in; router_options weight_decay=true
    and z_loss=true keep both, as for top-k."""
    from omegaconf import OmegaConf

    from runs.config import CONFIG_DIR
    from training.optim import build_optimizer

    def decay_of_router_weights(model, name):
        optimizer = build_optimizer(model, OmegaConf.load(CONFIG_DIR / "optimizer" / f"{name}.yaml"), lr=1e-3)
        groups = [g for part in getattr(optimizer, "parts", [optimizer]) for g in part.param_groups]
        routers = {id(block.ffn.router.weight) for block in model.layers}
        found = [(type(part).__name__, g["weight_decay"]) for part in getattr(optimizer, "parts", [optimizer])
                 for g in part.param_groups for p in g["params"] if id(p) in routers]
        assert len(found) == 2 and sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
        return set(found)

    for options, decayed in [({}, False), (dict(weight_decay=True), True)]:
        model = tiny_lm(router_options=options)
        assert decay_of_router_weights(model, "muon") == {("Muon", 0.1 if decayed else 0.0)}
        assert decay_of_router_weights(model, "adamw") == {("AdamW", 0.1 if decayed else 0.0)}
        other = build_optimizer(model, OmegaConf.load(CONFIG_DIR / "optimizer" / "muon.yaml"), lr=1e-3).parts[0]
        q_proj = model.layers[0].mixer.q_proj.weight
        assert [g["weight_decay"] for g in other.param_groups if any(p is q_proj for p in g["params"])] == [0.1]
    for options, coef in [({}, 0.0), (dict(z_loss=True), 1e-3)]:
        aux = AuxCollector()
        model = tiny_lm(router_options=options).train()
        model.layers[0].ffn(torch.randn(1, 5, 32), aux, torch.arange(5).view(1, 5))
        (z, got), = aux.losses["moe/z_loss"]
        assert got == coef and z.item() > 0  # logged either way


@pytest.mark.parametrize("options,matmuls", [({}, 2), ({"policy_grad_to_input": True}, 1),
                                             ({"baseline": "value"}, 2)])
def test_flops_count_the_training_forwards_matmuls(options, matmuls):
    """flops_per_token against torch's FlopCounterMode over a training forward: the logits, again from the
    detached input unless policy_grad_to_input, and the value head's v . x (a matrix-vector product, which the
    counter does not see unless told: 2 FLOPs per multiply-add); evaluation runs the logits only."""
    from torch.utils.flop_counter import FlopCounterMode

    def mv_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * a_shape[0] * a_shape[1]

    N, E, d = 9, 4, 6
    r = router(E, 2, d, **options)
    x = torch.randn(N, d, dtype=F64)
    ids = torch.arange(N).view(1, N)
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.mv: mv_flops}) as counter:
        reinforce_losses(r, x, ids, torch.rand(N, dtype=F64))
    assert counter.get_total_flops() / N == r.flops_per_token() == 2 * d * E * matmuls + 2 * d * (r.value is not None)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        r.eval()(x, ids)
    assert counter.get_total_flops() / N == 2 * d * E


def test_sample_log_prob_sums_the_slots():
    logits = torch.tensor([[0.5, -1.0, 2.0]], dtype=F64)
    p = logits.softmax(-1)[0]
    got = sample_log_prob(logits, torch.tensor([[2, 0]]))
    assert got.item() == pytest.approx((p[2] * p[0] / (1 - p[2])).log().item(), rel=1e-12)


def test_a_checkpoint_without_the_token_table_loads_with_a_fresh_one(tmp_path):
    """A model saved with another baseline (or before the token table existed), loaded under a config.json whose
    router_options leave baseline at its default: the table starts at 0 (not uninitialised memory), the saved
    step count stays, and training runs."""
    import json

    model = tiny_lm(router_options=dict(baseline="mean"))
    model.layers[0].ffn.router.steps.fill_(5)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["ffn_options"]["moe"]["router_options"] = {}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = DecoderLM.from_pretrained(tmp_path)
    r = loaded.layers[0].ffn.router
    assert r.options.baseline == "token_table" and r.steps.item() == 5
    assert torch.equal(r.reward_table, torch.zeros(64, dtype=F64)) and torch.equal(r.table_updates, torch.zeros(64, dtype=torch.long))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(8))
    assert torch.isfinite(loaded.train()(ids, labels=ids).loss)
