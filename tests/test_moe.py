"""MoE FFN: the dispatched layer against a per-token loop written from the formula (float64), the
balance and z losses by hand, router gradients, aux-free balancing (one process and 2-rank gloo),
and a tiny DecoderLM training with MoE layers."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from model import DecoderLM, LMConfig
from model.ffn.experts import ExpertsLoop, experts_grouped_mm
from model.ffn.moe import MoE
from model.layers import AuxCollector

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def make_moe(d=12, layers=2, **options) -> MoE:
    config = LMConfig(hidden_size=d, num_hidden_layers=layers, ffn="moe", ffn_options={"moe": options})
    m = MoE(config, layer_idx=1)
    m.router.init_parameters()
    m.init_parameters()
    return m


def randomise(m: MoE, seed=0) -> MoE:
    """Weights large enough that routing is decisive and every expert's output matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / math.sqrt(p.shape[-1]))
        if m.aux_free_bias:
            m.expert_bias.copy_(0.05 * torch.randn(m.num_experts, generator=g, dtype=m.expert_bias.dtype))
    return m


@torch.no_grad()
def naive_moe(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per token: scores, top-k on scores + bias, gates, capacity in token order, then
    y = shared(x) + sum_i g_i (silu(x W_g,i) * x W_u,i) W_d,i."""
    E, k, f = m.num_experts, m.top_k, m.expert_size
    xf = x.reshape(-1, x.shape[-1])
    N = xf.shape[0]
    capacity = math.ceil(m.capacity_factor * N * k / E) if m.capacity_factor is not None else N * k
    used = [0] * E
    out = torch.zeros_like(xf)
    for t in range(N):
        logits = m.router.weight @ xf[t]
        s = torch.softmax(logits, 0) if m.router.options.score_func == "softmax" else torch.sigmoid(logits)
        choice = s + (m.expert_bias if m.aux_free_bias else 0)
        chosen = sorted(range(E), key=lambda i: -float(choice[i]))[:k]
        total = sum(s[i] for i in chosen)
        for i in chosen:
            g = (s[i] / total if m.router.options.norm_topk_prob else s[i]) * m.router.options.route_scale
            if used[i] >= capacity:
                continue
            used[i] += 1
            w_gate, w_up = m.gate_up_proj[i][:, :f], m.gate_up_proj[i][:, f:]
            out[t] += g * ((F.silu(xf[t] @ w_gate) * (xf[t] @ w_up)) @ m.down_proj[i])
        if m.shared is not None:
            sh = m.shared
            out[t] += sh.down_proj.weight @ (F.silu(sh.gate_proj.weight @ xf[t]) * (sh.up_proj.weight @ xf[t]))
    return out.view(x.shape)


@pytest.mark.parametrize("options", [
    dict(top_k=1, router_options=dict(norm_topk_prob=False)),
    dict(top_k=2),
    dict(top_k=3, num_shared_experts=2, router_options=dict(score_func="sigmoid", route_scale=2.5)),
    dict(top_k=2, capacity_factor=0.7),
    dict(top_k=1, capacity_factor=0.5, num_shared_experts=1, router_options=dict(norm_topk_prob=False)),
    dict(top_k=2, aux_free_bias=True, capacity_factor=1.0),
])
def test_dispatch_matches_per_token_reference(options):
    m = randomise(make_moe(num_experts=6, expert_intermediate_size=7, **options).double())
    x = torch.randn(3, 11, 12, dtype=F64)  # 33 tokens
    aux = AuxCollector()
    y = m(x, aux)
    torch.testing.assert_close(y, naive_moe(m, x), rtol=1e-12, atol=1e-12)
    dropped = float(aux.summary()["moe/dropped_frac"])
    assert (dropped > 0) == ("capacity_factor" in options)


def test_gradients_float64():
    """Whole layer (router through the gates, experts, shared) against finite differences."""
    m = randomise(make_moe(d=6, num_experts=4, top_k=2, expert_intermediate_size=5, num_shared_experts=1,
                           capacity_factor=0.8).double())
    x = torch.randn(9, 6, dtype=F64, requires_grad=True)
    params = [m.router.weight, m.gate_up_proj, m.down_proj]
    torch.autograd.gradcheck(lambda x, *p: m(x), (x, *params), fast_mode=True)


def test_experts_loop_and_grouped_mm_agree():
    """The CPU loop (hand-written backward, an expert with no rows) and the grouped-mm path used on
    CUDA, which torch also runs on CPU in fp32."""
    g = torch.Generator().manual_seed(1)
    counts = [5, 0, 9, 2]
    xs = torch.randn(16, 8, generator=g, dtype=F64, requires_grad=True)
    w_gu = torch.randn(4, 8, 16, generator=g, dtype=F64, requires_grad=True)  # fp32 grouped mm: 16-byte rows
    w_d = torch.randn(4, 8, 8, generator=g, dtype=F64, requires_grad=True)
    torch.autograd.gradcheck(lambda *a: ExpertsLoop.apply(*a, counts), (xs, w_gu, w_d))
    inputs = [t.detach().float().requires_grad_() for t in (xs, w_gu, w_d)]
    ref = [t.detach().float().requires_grad_() for t in (xs, w_gu, w_d)]
    gy = torch.randn(16, 8, generator=g)
    ExpertsLoop.apply(*inputs, counts).backward(gy)
    out = experts_grouped_mm(*ref, torch.tensor(counts))
    out.backward(gy)
    torch.testing.assert_close(ExpertsLoop.apply(*inputs, counts), out, rtol=1e-5, atol=1e-5)
    for a, b in zip(inputs, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k,norm", [(1, False), (2, True)])
def test_router_gets_gradient_through_gates(top_k, norm):
    m = randomise(make_moe(num_experts=4, top_k=top_k, router_options=dict(norm_topk_prob=norm), expert_intermediate_size=5))
    m(torch.randn(20, 12)).square().sum().backward()  # no aux: only the gates reach the router
    assert m.router.weight.grad is not None and m.router.weight.grad.abs().sum() > 0


def router_layer(logits: torch.Tensor, k: int) -> MoE:
    """A layer whose router logits equal its input (d = E, W_r = I)."""
    E = logits.shape[-1]
    m = make_moe(d=E, num_experts=E, top_k=k, expert_intermediate_size=3).double()
    with torch.no_grad():
        m.router.weight.copy_(torch.eye(E, dtype=F64))
    return m


def test_balance_and_z_loss_by_hand():
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0],
                           [1.5, 1.0, 0.2, -0.3],
                           [0.1, 0.3, 2.2, -2.0],
                           [3.0, -1.0, 0.0, 0.4],
                           [0.0, 0.0, 0.1, 0.9]], dtype=F64)
    m = router_layer(logits, k=2)
    aux = AuxCollector()
    m(logits, aux)
    # top-2 per row: {0,1}, {0,1}, {2,1}, {0,3}, {3,2}: counts 3, 3, 2, 2 over 10 assignments.
    f = [0.3, 0.3, 0.2, 0.2]
    rows = [[math.exp(v) for v in row] for row in logits.tolist()]
    P = [sum(r[i] / sum(r) for r in rows) / 5 for i in range(4)]
    balance = 4 * sum(fi * pi for fi, pi in zip(f, P))
    z = sum(math.log(sum(r)) ** 2 for r in rows) / 5
    summary = aux.summary()
    assert summary["moe/balance_loss"].item() == pytest.approx(balance, rel=1e-6)  # logged as fp32
    assert summary["moe/z_loss"].item() == pytest.approx(z, rel=1e-6)
    torch.testing.assert_close(summary["moe/layer1/load"], torch.tensor(f, dtype=torch.float32))
    assert summary["moe/imbalance"].item() == pytest.approx(0.3 * 4)
    # coefficients weight the losses in the total; 0 disables the addition but still logs
    assert aux.total_loss().item() == pytest.approx(1e-2 * balance + 1e-3 * z, rel=1e-12)  # float64


@pytest.mark.parametrize("k", [1, 2])
def test_balance_loss_is_one_when_balanced(k):
    """Token t prefers expert t mod E, then t+1: cyclic symmetry makes f_i = P_i = 1/E."""
    E = 4
    logits = torch.zeros(2 * E, E, dtype=F64)
    for t in range(2 * E):
        logits[t, t % E], logits[t, (t + 1) % E] = 3.0, 1.0
    aux = AuxCollector()
    router_layer(logits, k)(logits, aux)
    assert aux.summary()["moe/balance_loss"].item() == pytest.approx(1.0, rel=1e-6)
    assert aux.summary()["moe/imbalance"].item() == pytest.approx(1.0)


def skewed_layer(seed=0, **options):
    """Expert 0 (and less so 1) aligned with a direction every token shares: most tokens pick them."""
    torch.manual_seed(seed)
    m = make_moe(d=16, num_experts=8, top_k=2, aux_free_bias=True, **options)
    shift = F.normalize(torch.randn(16), dim=0)
    with torch.no_grad():
        w = 0.25 * torch.randn(8, 16)
        w[0] += shift
        w[1] += 0.5 * shift
        m.router.weight.copy_(w)
    return m, torch.randn(256, 16) + 2 * shift


def test_aux_free_bias_balances_a_skewed_router():
    m, x = skewed_layer()  # gamma = 1e-3, the default
    m.train()
    imbalance = []
    for _ in range(300):
        m(x)
        imbalance.append((m.pending_counts.max() / m.pending_counts.mean()).item())
        m.after_optimizer_step()
    assert imbalance[0] > 2.5
    assert max(imbalance[-20:]) < 1.1
    assert abs(m.expert_bias.sum().item()) < 1e-5  # mean-centred
    # the bias is a saved buffer that takes no gradient, and the gates do not see it
    assert "expert_bias" in m.state_dict() and not m.expert_bias.requires_grad
    m(x).sum().backward()
    assert m.expert_bias.grad is None
    routing = m.router(x, None, m.expert_bias)
    scores = m.router.scores(x)[1].gather(-1, routing.expert.view(-1, 2))
    torch.testing.assert_close(routing.gate.view(-1, 2), scores / scores.sum(-1, keepdim=True))


def test_bias_update_rule():
    m, _ = skewed_layer(bias_update_rate=0.5)
    m.pending_counts = torch.tensor([10.0, 0, 3, 3, 3, 3, 2, 0])  # mean 3
    m.after_optimizer_step()
    sign = torch.tensor([-1.0, 1, 0, 0, 0, 0, 1, 1])
    torch.testing.assert_close(m.expert_bias, 0.5 * (sign - sign.mean()))
    assert m.pending_counts is None
    m.eval()
    m(torch.randn(4, 16))  # eval forwards do not count
    assert m.pending_counts is None


def _ddp_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    m, x = skewed_layer(bias_update_rate=0.1)
    m.train()
    m(x[rank * 100: rank * 100 + 50 + 200 * rank])  # different tokens and token counts per rank
    local = m.pending_counts.clone()
    m.after_optimizer_step()
    torch.save({"local": local, "bias": m.expert_bias.clone()}, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_bias_update_all_reduces_counts_over_ranks(tmp_path):
    import torch.multiprocessing as mp

    # fork: the workers inherit the imported modules instead of importing torch and transformers again
    mp.start_processes(_ddp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert not torch.equal(r0["local"], r1["local"])
    torch.testing.assert_close(r0["bias"], r1["bias"], rtol=0, atol=0)
    load = r0["local"] + r1["local"]
    expected = 0.1 * torch.sign(load.mean() - load)
    torch.testing.assert_close(r0["bias"], expected - expected.mean())


def tiny_lm(ffn, **options) -> DecoderLM:
    torch.manual_seed(0)
    config = LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, ffn=ffn,
                      ffn_options={"moe": dict(num_experts=4, top_k=2, expert_intermediate_size=16, **options)})
    return DecoderLM(config)


def routed_output_cost(model: DecoderLM, data: torch.Tensor) -> float:
    """How much the LM loss (eval mode) rises when every MoE layer's routed experts are cut out (the
    layer's output replaced by its shared experts' alone, or zeros without them)."""

    def shared_only(module, args, out):
        return module.shared(args[0]) if module.shared is not None else torch.zeros_like(out)

    was_training = model.training
    model.eval()
    with torch.no_grad():
        full = model(data, labels=data).lm_loss.item()
        hooks = [m.register_forward_hook(shared_only) for m in model.modules() if isinstance(m, MoE)]
        assert hooks
        ablated = model(data, labels=data).lm_loss.item()
    for h in hooks:
        h.remove()
    model.train(was_training)
    return ablated - full


@pytest.mark.parametrize("ffn,options", [
    ("moe", dict(aux_free_bias=True, num_shared_experts=1)),
    (["dense", "moe"], dict(capacity_factor=1.25, router_options=dict(score_func="sigmoid"))),
])
def test_tiny_lm_trains(ffn, options):
    """The loss falls, and what was learnt runs through the routed experts: cutting them out (shared
    experts kept) costs the trained model far more loss than it cost the model at init (it would cost
    nothing if their output never reached the model)."""
    model = tiny_lm(ffn, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(0))
    at_init = routed_output_cost(model, data)
    losses = []
    for _ in range(8):
        out = model(data, labels=data)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        for module in model.modules():
            if hasattr(module, "after_optimizer_step"):
                module.after_optimizer_step()
        losses.append(out.lm_loss.item())
    assert losses[-1] < losses[0] - 0.3
    trained = routed_output_cost(model, data)
    assert trained > 0.02 and trained > 20 * abs(at_init), (at_init, trained)
    metrics = out.aux_metrics
    for name in ("balance_loss", "z_loss", "imbalance", "load_cv", "dead_experts", "router_entropy", "dropped_frac"):
        assert f"moe/{name}" in metrics
    assert metrics["moe/layer1/load"].shape == (4,)
    assert metrics["moe/layer1/load"].sum().item() == pytest.approx(1.0)
    moe_layers = [i for i, name in enumerate(model.config.layer_ffns) if name == "moe"]
    expected = sum(1e-2 * metrics[f"moe/layer{i}/balance_loss"] + 1e-3 * metrics[f"moe/layer{i}/z_loss"]
                   for i in moe_layers)
    assert out.aux_loss.item() == pytest.approx(expected.item(), rel=1e-5)
    model.eval()
    assert not any("load" in k for k in model(data).aux_metrics)  # load telemetry in training only


def test_accounting_checkpoint_roundtrip_and_decoding(tmp_path):
    model = tiny_lm("moe", aux_free_bias=True)
    with torch.no_grad():
        model.layers[0].ffn.expert_bias.copy_(torch.tensor([0.3, -0.1, -0.1, -0.1]))
    d, f, E, k = 32, 16, 4, 2
    counts = model.parameter_counts()
    assert counts["total"] - counts["active"] == 2 * (E - k) * 3 * d * f
    assert model.layers[0].ffn.flops_per_token() == 2 * d * E + k * 2 * 3 * d * f
    model.save_pretrained(tmp_path)
    loaded = DecoderLM.from_pretrained(tmp_path)
    torch.testing.assert_close(loaded.layers[0].ffn.expert_bias, model.layers[0].ffn.expert_bias)
    data = torch.randint(0, 64, (2, 10))
    full = model(data).logits
    torch.testing.assert_close(loaded(data).logits, full)
    # decoding: dropless routing is per token, so prefill + one step equals the full forward
    prefill = model(data[:, :9], use_cache=True)
    step = model(data[:, 9:], past_key_values=prefill.past_key_values, use_cache=True)
    torch.testing.assert_close(step.logits[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)


def test_bad_options():
    with pytest.raises(ValueError, match="score_func"):
        make_moe(router_options=dict(score_func="relu"))
    with pytest.raises(ValueError, match="top_k"):
        make_moe(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="unknown moe option"):
        make_moe(num_expert=4)


def test_autocast_bf16_runs_experts_in_bf16_and_routes_in_fp32():
    m = randomise(make_moe(num_experts=4, top_k=2, expert_intermediate_size=8, num_shared_experts=1))
    x = torch.randn(10, 12)
    ref = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
        assert m.router(x).logits.dtype == torch.float32
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=5e-2, atol=5e-2)
    y.float().sum().backward()
    assert m.gate_up_proj.grad.dtype == torch.float32 and m.router.weight.grad.abs().sum() > 0


def test_moe_report_plots(tmp_path):
    from runs.metrics import read_metrics, to_python
    from runs.plots import plot_run

    model = tiny_lm(["dense", "moe"])
    data = torch.randint(0, 64, (2, 16))
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 4):
            out = model(data, labels=data)
            f.write(json.dumps({"step": step, **{k: to_python(v) for k, v in out.aux_metrics.items()}}) + "\n")
    paths = plot_run(tmp_path, read_metrics(tmp_path))
    assert sorted(p.name for p in paths) == ["moe_imbalance.png", "moe_load_heatmap.png"]  # no train/loss rows
    assert all(p.stat().st_size > 1000 for p in paths)
    empty = tmp_path / "dense_run"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text(json.dumps({"step": 1, "tokens_seen": 64, "train/loss": 3.0}) + "\n")
    assert [p.name for p in plot_run(empty, read_metrics(empty))] == ["loss.png"]  # no MoE plots for a dense run
