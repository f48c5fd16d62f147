"""Optimizers: which parameters Muon and AdamW get (a model with every mixer and MoE), stacked expert
weights stepped as separate matrices, the float32 CPU step against torch's Muon step, one scheduler
driving both parts across a state_dict round trip, FSDP refused; optimizer=adamw is a single AdamW.
Schedules: every step's lr of cosine, wsd and constant against their formulas."""
import math

import pytest
import torch
from accelerate.utils import DistributedType
from omegaconf import OmegaConf

from model import DecoderLM, LMConfig
from runs.config import CONFIG_DIR
from training.optim import (SCHEDULES, CombinedOptimizer, Muon, build_optimizer, build_scheduler, muon_split,
                            orthogonalize)

MIXERS = ["softmax", "gdn", "derived_gdn", "mamba2", "linear", "dsa"]


pytestmark = pytest.mark.usefixtures("one_thread")


def every_block_model(**kw) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(LMConfig(vocab_size=97, mixer=MIXERS, ffn=["moe", "dense"] * 3, hidden_size=32,
                              num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2,
                              intermediate_size=64, eos_token_id=0, **kw))


def optimizer_cfg(name: str, **overrides):
    return OmegaConf.merge(OmegaConf.load(CONFIG_DIR / "optimizer" / f"{name}.yaml"), overrides)


def test_muon_split_names():
    model = every_block_model()
    matrices, stacked, rest = (dict(part) for part in muon_split(model))
    names = {n for n, _ in model.named_parameters()}
    assert len(matrices) + len(stacked) + len(rest) == len(names) and set(matrices) | set(stacked) | set(rest) == names
    # Hidden matrices: every linear weight of every block, the router and the DSA indexer included.
    assert all(n.startswith("layers.") and n.endswith("_proj.weight") or n.endswith("router.weight") for n in matrices)
    for layer, expected in enumerate([
        {"q_proj", "k_proj", "v_proj", "o_proj"},
        {"q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj"},
        {"q_proj", "k_proj", "v_proj", "o_proj"},
        {"in_proj", "out_proj"},
        {"q_proj", "k_proj", "v_proj", "o_proj"},
        {"q_proj", "k_proj", "v_proj", "o_proj", "indexer.q_proj", "indexer.k_proj", "indexer.w_proj"},
    ]):
        mixer = {n.removeprefix(f"layers.{layer}.mixer.").removesuffix(".weight") for n in matrices
                 if n.startswith(f"layers.{layer}.mixer.")}
        assert mixer == expected, (layer, mixer)
    assert {f"layers.{i}.ffn.router.weight" for i in (0, 2, 4)} <= set(matrices)
    assert {f"layers.{i}.ffn.{w}_proj.weight" for i in (1, 3, 5) for w in ("gate", "up", "down")} <= set(matrices)
    # Stacked experts: the MoE layers' [E, in, out] weights, nothing else (conv weights are 3-D too).
    assert set(stacked) == {f"layers.{i}.ffn.{w}" for i in (0, 2, 4) for w in ("gate_up_proj", "down_proj")}
    # AdamW: embeddings (tied lm_head), norms, gates/decays, convs.
    assert {"embed_tokens.weight", "norm.weight", "layers.1.mixer.A_log", "layers.1.mixer.dt_bias",
            "layers.3.mixer.A_log", "layers.3.mixer.dt_bias", "layers.3.mixer.D", "layers.3.mixer.conv.conv.weight",
            "layers.3.mixer.conv.conv.bias", "layers.1.mixer.q_conv.conv.weight", "layers.5.mixer.indexer.k_norm.bias",
            } <= set(rest)
    assert all(p.ndim == 1 or "conv" in n or n == "embed_tokens.weight" for n, p in rest.items()), rest.keys()

    untied = dict(muon_split(every_block_model(tie_word_embeddings=False))[2])
    assert "lm_head.weight" in untied and "embed_tokens.weight" in untied

    opt = build_optimizer(model, optimizer_cfg("muon"), lr=1e-3)
    muon, adamw = opt.parts
    assert isinstance(muon, Muon) and type(adamw) is torch.optim.AdamW
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert {by_id[id(p)] for g in muon.param_groups for p in g["params"]} == set(matrices) | set(stacked)
    decayed = {by_id[id(p)] for g in adamw.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {n for n in rest if "conv.weight" in n}  # as optimizer=adamw: matrices only, no embeddings


def test_adamw_is_one_torch_adamw_as_before():
    model = every_block_model()
    opt = build_optimizer(model, optimizer_cfg("adamw"), lr=1e-3)
    assert type(opt) is torch.optim.AdamW and opt.defaults["betas"] == (0.9, 0.95)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and model.embed_tokens.weight in no_decay["params"]


@pytest.mark.parametrize("step", [torch.optim.Muon.step, Muon.step], ids=["torch-step", "cpu-float32-step"])
def test_stacked_experts_step_as_separate_matrices(step):
    """Muon on a [E, m, n] stack equals Muon on E separate [m, n] parameters (same grads), through
    torch's step (bf16 Newton-Schulz, what CUDA runs) and our float32 CPU step alike; shape-dependent
    lr included (m != n)."""
    torch.manual_seed(0)
    stack = torch.nn.Parameter(torch.randn(3, 8, 20))
    singles = [torch.nn.Parameter(w.detach().clone()) for w in stack]
    matrix = torch.nn.Parameter(torch.randn(6, 5))
    ours = Muon([matrix], [stack], lr=0.02, adjust_lr_fn="match_rms_adamw")
    ref = Muon(singles, [], lr=0.02, adjust_lr_fn="match_rms_adamw")
    start = stack.detach().clone()
    for _ in range(3):  # the momentum buffer carries over
        grad = torch.randn(3, 8, 20)
        stack.grad, matrix.grad = grad.clone(), torch.randn(6, 5)
        for w, g in zip(singles, grad):
            w.grad = g.clone()
        step(ours)
        step(ref)
    assert not torch.equal(stack, start)
    for w, single in zip(stack, singles):
        torch.testing.assert_close(w, single, rtol=0, atol=0)
    assert ours.state[stack]["momentum_buffer"].shape == (3, 8, 20)


def test_cpu_step_is_torch_muon_up_to_bf16():
    """Our CPU step (float32 Newton-Schulz) against torch.optim.Muon's (bf16), weight decay and the
    match_rms_adamw lr included; and against a float64 run of the same iteration."""
    torch.manual_seed(0)
    shapes = [(16, 48), (48, 16), (32, 32)]
    ours = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    start = [p.detach().clone() for p in ours]
    options = dict(lr=0.05, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    opt_ours, opt_theirs = Muon(ours, [], **options), torch.optim.Muon(theirs, **options)
    for _ in range(2):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt_ours.step()
        opt_theirs.step()
    for a, b, s in zip(ours, theirs, start):
        ours_delta, theirs_delta = a - s, b - s
        assert (ours_delta - theirs_delta).norm() < 0.02 * theirs_delta.norm()
    g = torch.randn(24, 40, dtype=torch.float64)
    coefficients = opt_ours.param_groups[0]["ns_coefficients"]
    torch.testing.assert_close(orthogonalize(g.float(), coefficients, 5, 1e-7).double(),
                               orthogonalize(g, coefficients, 5, 1e-7), rtol=1e-4, atol=1e-5)


def lr_factor(schedule: str, step: int, warmup: int, total: int, min_ratio: float, decay_fraction: float = 0.2):
    """lr / trainer.lr after `step` scheduler steps, written from the formulas: linear warm-up over
    `warmup` steps (from 0; wsd's from min_ratio, as transformers' get_wsd_schedule), then
    cosine: min_ratio + (1 - min_ratio) (1 + cos(pi p)) / 2, p = (step - warmup) / (total - warmup);
    wsd: 1 until the last int(decay_fraction total) steps, over which the same cosine decays to min_ratio;
    constant: 1."""
    if step < warmup:
        return step / warmup if schedule != "wsd" else min_ratio + (1 - min_ratio) * step / warmup
    if schedule == "constant":
        return 1.0
    start = warmup if schedule == "cosine" else total - int(decay_fraction * total)
    p = min(1.0, max(0.0, (step - start) / (total - start)))
    return min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * p)) / 2


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_lr_at_every_step_is_the_formula(schedule):
    warmup, total, min_ratio, decay_fraction = 4, 20, 0.1, 0.25
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    scheduler = build_scheduler(opt, OmegaConf.create({"schedule": schedule, "warmup_steps": warmup, "max_steps": total,
                                                       "min_lr_ratio": min_ratio, "wsd_decay_fraction": decay_fraction}))
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(total):
        opt.step()
        scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
    factors = [lr_factor(schedule, s, warmup, total, min_ratio, decay_fraction) for s in range(total + 1)]
    assert lrs == pytest.approx([0.5 * f for f in factors], rel=1e-12, abs=1e-15)
    # the formulas' landmarks: the peak after warm-up, the floor (cosine, wsd) at the last step
    assert factors[warmup] == 1.0 and factors[warmup // 2] == {"wsd": 0.55}.get(schedule, 0.5)
    assert factors[total] == pytest.approx({"constant": 1.0}.get(schedule, min_ratio))
    if schedule == "cosine":
        assert factors[(warmup + total) // 2] == pytest.approx((1 + min_ratio) / 2)
    if schedule == "wsd":  # stable until the last int(0.25 x 20) = 5 steps
        assert factors[15] == 1.0 and factors[16] < 1.0


def test_one_scheduler_drives_both_parts_after_a_state_dict_round_trip():
    model = every_block_model()
    opt = build_optimizer(model, optimizer_cfg("muon"), lr=1e-2)
    schedule = build_scheduler(opt, OmegaConf.create(
        {"schedule": "cosine", "warmup_steps": 2, "max_steps": 10, "min_lr_ratio": 0.1}))
    opt.load_state_dict(opt.state_dict())  # as Accelerate's prepare and load_state do
    x = torch.randint(0, 97, (2, 24))
    for _ in range(4):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad()
    lr = schedule.get_last_lr()[0]
    assert lr == pytest.approx(1e-2 * lr_factor("cosine", 4, warmup=2, total=10, min_ratio=0.1))
    assert [g["lr"] for part in opt.parts for g in part.param_groups] == [lr] * 4
    assert all(s["momentum_buffer"].abs().sum() > 0 for s in opt.parts[0].state.values())
    fresh = build_optimizer(every_block_model(), optimizer_cfg("muon"), lr=1e-2)
    fresh.load_state_dict(opt.state_dict())
    assert isinstance(fresh, CombinedOptimizer) and [g["lr"] for g in fresh.param_groups] == [lr] * 4


def test_muon_under_fsdp_fails_in_one_line():
    with pytest.raises(ValueError, match="optimizer=muon .* FSDP shards them") as e:
        build_optimizer(every_block_model(), optimizer_cfg("muon"), 1e-3, DistributedType.FSDP)
    assert "\n" not in str(e.value)
    assert isinstance(build_optimizer(every_block_model(), optimizer_cfg("muon"), 1e-3, DistributedType.MULTI_GPU),
                      CombinedOptimizer)
