"""router=reinforce (model/ffn/routers/reinforce.py) in numbers: the REINFORCE gradient against a hand
computation (k = 1 and Plackett-Luce k = 2), exactly 0 when every reward equals the baseline, greedy
evaluation equal to top-k on the same logits, sampling frequencies against the policy on 10^5 draws
(chi-square), sampling seeded per token (layout-independent, new each step), the baselines, the
token losses the model hands over through the aux channel (reward -CE per token) and the telemetry. DDP, EP, decoding and export: with
the other routers in tests/test_moe_routers_ddp.py, tests/test_expert_parallel.py and
tests/test_moe_routers.py."""
import pytest
import torch

from model import DecoderLM, LMConfig
from model.ffn.moe import MoEOptions
from model.ffn.routers.reinforce import Reinforce, context_keys, sample_log_prob
from model.ffn.routers.topk import TopK
from model.layers import AuxCollector

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")


def router(E=4, k=1, d=6, seed=0, layer_idx=0, **options) -> Reinforce:
    torch.manual_seed(seed)
    moe = MoEOptions(router="reinforce", num_experts=E, top_k=k, router_options=options)
    r = Reinforce(LMConfig(hidden_size=d), layer_idx, moe).double()
    with torch.no_grad():
        r.weight.normal_(0, 1)
    return r.train()


def reinforce_losses(r: Reinforce, x, ids, token_loss, labelled=None, bias=None) -> AuxCollector:
    """A training forward with the aux channel, then the token losses the model would hand over."""
    aux = AuxCollector()
    r(x, ids, bias, aux)
    aux.give_token_loss(lambda: token_loss, torch.ones(len(x), dtype=torch.bool) if labelled is None else labelled)
    return aux


def set_baseline(r: Reinforce, value: float) -> None:
    """One update of the moving average at decay 0.5 whose bias-corrected value is `value`."""
    r.decay = 0.5
    r.reward_average.fill_(0.5 * value)
    r.steps.fill_(1)


@pytest.mark.parametrize("k", [1, 2])
def test_reinforce_gradient_by_hand(k):
    """L = coef mean_t -(r_t - b) log pi(e_t) over the labelled tokens; d log pi / dz for the ordered
    draw: sum_j onehot(e_j) - softmax(z without e_1..e_{j-1})."""
    N, E, d = 7, 4, 6
    r = router(E, k, d, loss_coef=0.3)
    set_baseline(r, -2.0)
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

    z = x @ r.weight.detach().t()
    p = z.softmax(-1)
    # the draw's probability, Plackett-Luce: p_e1 [p_e2 / (1 - p_e1)]
    want_logp = p.gather(1, experts[:, :1]).log()[:, 0]
    if k == 2:
        p1 = p.gather(1, experts[:, :1])[:, 0]
        want_logp = want_logp + (p.gather(1, experts[:, 1:])[:, 0] / (1 - p1)).log()
    advantage = (reward - (-2.0)) * labelled
    torch.testing.assert_close(value.detach(), -(advantage * want_logp).sum() / labelled.sum(), rtol=1e-12, atol=1e-12)
    dz = torch.zeros(N, E, dtype=F64)
    removed = torch.zeros(N, E, dtype=torch.bool)
    for j in range(k):
        dz += torch.nn.functional.one_hot(experts[:, j], E) - z.masked_fill(removed, float("-inf")).softmax(-1)
        removed[torch.arange(N), experts[:, j]] = True
    dz = -0.3 * advantage[:, None] * dz / labelled.sum()
    torch.testing.assert_close(r.weight.grad, dz.t() @ x, rtol=1e-12, atol=1e-12)


def test_no_policy_gradient_when_every_reward_is_the_baseline():
    r = router(E=4, k=2)
    set_baseline(r, -3.25)
    x = torch.randn(9, 6, dtype=F64)
    aux = reinforce_losses(r, x, torch.arange(9).view(1, 9), torch.full((9,), 3.25, dtype=F64))
    (value, coef), = aux.losses["moe/reinforce_loss"]
    (value * coef).backward()
    assert r.weight.grad is not None and torch.equal(r.weight.grad, torch.zeros_like(r.weight))


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


@pytest.mark.parametrize("k", [1, 2])
def test_sampling_frequencies_follow_the_policy(k):
    """10^5 tokens with the same logits and different contexts: the counts of each (ordered) draw
    against N pi (k = 1) or N p_a p_b / (1 - p_a) (k = 2), chi-square below its 0.1% critical value."""
    E, N = 4, 100_000
    r = router(E, k, d=E)
    with torch.no_grad():
        r.weight.copy_(torch.eye(E, dtype=F64))
    logits = torch.tensor([1.0, 0.2, -0.5, 0.7], dtype=F64)
    routing = r(logits.expand(N, E), torch.arange(N).view(N, 1))
    experts = routing.expert.view(N, k)
    p = logits.softmax(-1)
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


def test_the_moving_average_baseline():
    """Before any update the forward's own mean reward; then the bias-corrected moving average of each
    optimizer step's mean reward (over all of the step's forwards)."""
    r = router(E=4, k=1, baseline_decay=0.9)
    x = torch.randn(6, 6, dtype=F64)
    ids = torch.arange(6).view(1, 6)

    def baseline_of_a_forward(reward: float) -> float:
        aux = reinforce_losses(r, x, ids, torch.full((6,), -reward, dtype=F64))
        return aux.metrics["moe/baseline"][0].item()

    assert baseline_of_a_forward(-1.0) == pytest.approx(-1.0)  # two forwards of one step, mean -2: before
    assert baseline_of_a_forward(-3.0) == pytest.approx(-3.0)  # any update, each forward's own mean
    r.after_optimizer_step()
    assert r.steps.item() == 1
    assert baseline_of_a_forward(-4.0) == pytest.approx(-2.0)  # bias-corrected: exactly the first step's mean
    r.after_optimizer_step()
    m = 0.9 * 0.1 * -2.0 + 0.1 * -4.0
    assert baseline_of_a_forward(0.0) == pytest.approx(m / (1 - 0.9**2))


def tiny_lm(**options) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=64, ffn="moe",
                              ffn_options={"moe": dict(router="reinforce", num_experts=4, top_k=2,
                                                       expert_intermediate_size=16, **options)}))


@pytest.mark.parametrize("baseline", ["mean", "value"])
def test_the_model_hands_each_router_minus_ce_and_logs_the_policy(baseline):
    """The reward of each router is the token's own -CE: its mean over the labelled tokens equals
    -lm_loss; the policy's telemetry is logged per layer and averaged; the value head (baseline=value)
    learns from its own loss only, and takes the router's input detached."""
    model = tiny_lm(router_options=dict(baseline=baseline, entropy_coef=0.01)).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    out = model(ids, labels=ids)
    m = out.aux_metrics
    assert m["moe/reward"].item() == pytest.approx(-out.lm_loss.item(), rel=1e-6)
    for name in ("reward", "baseline", "advantage_var", "policy_entropy", "resampled_frac"):
        assert f"moe/layer0/{name}" in m and f"moe/layer1/{name}" in m and f"moe/{name}" in m
    # no bias: the router's entropy, here over the labelled tokens only (not the rows' last)
    assert m["moe/policy_entropy"].item() == pytest.approx(m["moe/router_entropy"].item(), rel=1e-3)
    assert 0 < m["moe/resampled_frac"] <= 1
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
    r = router(E=4, k=1)
    set_baseline(r, 0.0)
    x = torch.randn(30, 6, dtype=F64)
    ids = torch.arange(30).view(1, 30)
    bias = torch.tensor([0.0, 0.0, 0.0, 50.0], dtype=F64)
    r.eval()
    assert (r(x, None, bias).expert == 3).all()
    r.train()
    assert (r(x, ids, bias).expert == 3).all()
    aux = reinforce_losses(r, x, ids, torch.full((30,), -1.0, dtype=F64), bias=bias)  # advantage 1: L = -mean log pi
    (value, _), = aux.losses["moe/reinforce_loss"]
    torch.testing.assert_close(value, -(x @ r.weight.t() + bias).log_softmax(-1)[:, 3].mean())


def test_sample_log_prob_sums_the_slots():
    logits = torch.tensor([[0.5, -1.0, 2.0]], dtype=F64)
    p = logits.softmax(-1)[0]
    got = sample_log_prob(logits, torch.tensor([[2, 0]]))
    assert got.item() == pytest.approx((p[2] * p[0] / (1 - p[2])).log().item(), rel=1e-12)
