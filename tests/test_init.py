"""Every block initialises as its reference says (the docstring of its file), nothing generic
overwrites it, loaded weights are never re-initialised, mamba2's memory path starts as strong as
mamba_ssm's, and every recurrent mixer leaves chance on a tiny MQAR instance."""
import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from conftest import reinitialised_over_nan
from data.mqar import mqar_slice
from model import DecoderLM, LMConfig
from model.mixers.delta_rule import DeltaRuleBlock
from model.registry import MIXERS
from model.config import PARAMETRIZATIONS
from model.ffn.routers import ROUTERS
from runs.config import CONFIG_DIR

STD, LAYERS, D = 0.02, 4, 128
RESIDUAL = 1 / math.sqrt(2 * LAYERS)
MAMBA2 = {"head_dim": 16, "state_size": 16, "chunk_size": 16}


pytestmark = pytest.mark.usefixtures("one_thread")


def build(mixer: str, ffn: str = "dense", d: int = D, layers: int = LAYERS, seed: int = 0, vocab: int = 64,
          **config) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(LMConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=4,
                              max_position_embeddings=64, mixer=mixer, ffn=ffn,
                              mixer_options={"mamba2": MAMBA2}, **config))


def assert_normal(w: torch.Tensor, std: float) -> None:
    """Zero-mean with this std, and normal rather than uniform (kurtosis 3, a uniform's is 1.8)."""
    w = w.detach().double().flatten()
    assert w.std().item() == pytest.approx(std, rel=0.08)
    assert abs(w.mean().item()) < 4 * std / math.sqrt(w.numel())
    assert (w**4).mean().item() / w.var().item() ** 2 > 2.5


def assert_uniform(w: torch.Tensor, bound: float) -> None:
    """U(-bound, bound): inside the bound, reaching close to it, with std bound / sqrt(3)."""
    w = w.detach().double().flatten()
    assert w.abs().max().item() <= bound and w.abs().max().item() > 0.9 * bound
    assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.08)


@pytest.mark.parametrize("name", ("softmax", "linear", "derived_gdn", "dsa"))
def test_attention_mixers_init_as_llama(name):
    mixer = build(name).layers[1].mixer
    for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj):
        assert_normal(proj.weight, STD)
    assert_normal(mixer.o_proj.weight, STD * RESIDUAL)
    if name == "dsa":  # DeepSeek-V3.2's indexer: N(0, std) projections, LayerNorm to identity
        ix = mixer.indexer
        for proj in (ix.q_proj, ix.k_proj, ix.w_proj):
            assert_normal(proj.weight, STD)
        assert torch.equal(ix.k_norm.weight, torch.ones_like(ix.k_norm.weight))
        assert torch.equal(ix.k_norm.bias, torch.zeros_like(ix.k_norm.bias))


def assert_dt_and_decay(mixer, low: float, high: float) -> None:
    dt = F.softplus(mixer.dt_bias.detach())
    assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
    A = mixer.A_log.detach().exp()
    assert A.min() >= low and A.max() <= high and A.std() > 0


@pytest.mark.parametrize("name", ["gdn", "deltaproduct"])  # fla's GatedDeltaProductPreTrainedModel inits as GDN's
def test_gdn_inits_as_fla(name):
    mixer = build(name).layers[1].mixer
    for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.g_proj, mixer.a_proj, mixer.b_proj):
        assert_normal(proj.weight, STD)
    for conv in (mixer.q_conv, mixer.k_conv, mixer.v_conv):  # fla's _init_weights draws its nn.Conv1d with the projections
        assert_normal(conv.conv.weight, STD)
    assert_normal(mixer.o_proj.weight, STD * RESIDUAL)
    assert_dt_and_decay(mixer, 0.0, 16.0)
    assert torch.equal(mixer.o_norm.weight, torch.ones_like(mixer.o_norm.weight))


def test_gdn2_inits_as_fla_layer_and_kda():
    mixer = build("gdn2").layers[1].mixer
    for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.b_proj, mixer.w_proj, *mixer.f_proj, *mixer.g_proj):
        assert_normal(proj.weight, STD)
    assert_normal(mixer.o_proj.weight, STD * RESIDUAL)
    assert_dt_and_decay(mixer, 1.0, 16.0)
    assert mixer.A_log.shape == (mixer.num_heads,) and mixer.dt_bias.shape == (mixer.key_dim,)
    assert (mixer.g_proj[1].bias == 0).all() and torch.equal(mixer.o_norm.weight, torch.ones_like(mixer.o_norm.weight))


@pytest.mark.parametrize("mixer", [name for name in MIXERS.names() if issubclass(MIXERS.get(name), DeltaRuleBlock)])
def test_delta_rule_conv_init_uniform_is_conv1ds_default(mixer):
    """conv_init=uniform: the short-conv kernels at nn.Conv1d's U(+-1/sqrt(conv_size)) (zoology's), the rest as the
    default draws them."""
    torch.manual_seed(0)
    block = DecoderLM(LMConfig(vocab_size=64, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=4,
                               mixer=mixer, mixer_options={mixer: {"conv_init": "uniform"}})).layers[1].mixer
    for conv in (block.q_conv, block.k_conv, block.v_conv):
        assert_uniform(conv.conv.weight, 1 / math.sqrt(block.conv_size))
    assert_normal(block.q_proj.weight, STD)


def test_mamba2_inits_as_mamba_ssm_with_transformers_decays():
    mixer = build("mamba2").layers[1].mixer
    # PyTorch's nn.Linear / nn.Conv1d defaults, U(+-1/sqrt(fan_in)): at d 128 std 0.051, not 0.02.
    assert_uniform(mixer.in_proj.weight, 1 / math.sqrt(D))
    assert_uniform(mixer.conv.conv.weight, 1 / math.sqrt(mixer.conv.kernel_size))
    assert_uniform(mixer.out_proj.weight, RESIDUAL / math.sqrt(mixer.d_inner))
    assert_dt_and_decay(mixer, 1.0, mixer.num_heads)
    assert torch.allclose(mixer.A_log.exp(), torch.arange(1.0, mixer.num_heads + 1))  # transformers' A = 1..H
    assert torch.equal(mixer.D, torch.ones_like(mixer.D))
    assert torch.equal(mixer.norm.weight, torch.ones_like(mixer.norm.weight))


@pytest.mark.parametrize("shared", (0, 1))
def test_ffns_init_as_llama_and_deepseek_v3(shared):
    model = build("softmax", ffn="moe", ffn_options={"moe": {"num_experts": 8, "num_shared_experts": shared}})
    moe = model.layers[1].ffn
    assert_normal(moe.router.weight, STD)
    assert_normal(moe.gate_up_proj, STD)
    assert_normal(moe.down_proj, STD * RESIDUAL)
    dense = [build("softmax").layers[1].ffn] + ([moe.shared] if shared else [])
    for mlp in dense:
        assert_normal(mlp.gate_proj.weight, STD)
        assert_normal(mlp.up_proj.weight, STD)
        assert_normal(mlp.down_proj.weight, STD * RESIDUAL)
    assert_normal(model.embed_tokens.weight, STD)


@pytest.mark.parametrize("router", ROUTERS.names())
def test_every_router_inits_its_own_parameters(router):
    """Each router's init_parameters() (the MoE no longer touches the router): W_r N(0, initializer_range)
    where there is one, reinforce's value head 0; written over NaN, as from_pretrained leaves missing ones."""
    options = {"router": router, "router_options": {"baseline": "value"} if router == "reinforce" else {}}
    model = reinitialised_over_nan(build("softmax", ffn="moe", d=64, layers=2, ffn_options={"moe": options}))
    params = dict(model.layers[1].ffn.router.named_parameters())
    assert sorted(params) == {"hash": [], "reinforce": ["value", "weight"]}.get(router, ["weight"])
    if "weight" in params:
        assert_normal(params["weight"], STD)
    if "value" in params:
        assert torch.equal(params["value"], torch.zeros_like(params["value"]))


@pytest.mark.parametrize("name", PARAMETRIZATIONS)
def test_parametrization_starts_the_model_as_declared(name):
    """The embedding N(0, 1/d) or N(0, 0.02), lm_head tied or N(0, 0.02), the mixer's residual write at 0.02 times
    1/sqrt(2 L) or not, every FFN's (dense, routed experts, shared experts) the same or 0; a tie_word_embeddings
    given wins over the default."""
    rule = PARAMETRIZATIONS[name]
    moe = {"moe": {"num_experts": 8, "num_shared_experts": 1}}
    model = build("softmax", ffn=["dense", "moe", "dense", "moe"], parametrization=name, ffn_options=moe)
    embedding_std = model.config.hidden_size ** -0.5 if rule.unit_embedding else STD
    assert_normal(model.embed_tokens.weight, embedding_std)
    assert (model.lm_head.weight is model.embed_tokens.weight) == rule.tied
    if not rule.tied:
        assert_normal(model.lm_head.weight, STD)
    residual = STD * (RESIDUAL if rule.rescale_residual else 1)
    assert_normal(model.layers[0].mixer.o_proj.weight, residual)
    writes = [model.layers[0].ffn.down_proj.weight, model.layers[1].ffn.down_proj, model.layers[1].ffn.shared.down_proj.weight]
    for w in writes:
        if rule.ffn_starts_at_zero:
            assert torch.equal(w, torch.zeros_like(w))
        else:
            assert_normal(w, residual)
    flipped = build("softmax", parametrization=name, tie_word_embeddings=not rule.tied)
    assert (flipped.lm_head.weight is flipped.embed_tokens.weight) != rule.tied
    assert_normal(flipped.embed_tokens.weight, embedding_std)


@pytest.mark.parametrize("mixer, declared", [("softmax", "llama"), ("linear", "llama"), ("derived_gdn", "llama"),
                                             ("dsa", "llama"), ("gdn", "fla"), ("mamba2", "mamba2"),
                                             (["mamba2", "mamba2", "mamba2", "softmax"], "llama")])
def test_per_mixer_parametrization_is_the_mixers_declared_one(mixer, declared):
    """per_mixer (experiment=mqar's) builds the model its mixers declare, bit for bit; a hybrid whose mixers
    disagree gets llama. The default is tied."""
    assert build(mixer).config.parametrization == "tied"
    per_mixer, named = build(mixer, parametrization="per_mixer"), build(mixer, parametrization=declared)
    assert per_mixer.config.parametrization_rule() == PARAMETRIZATIONS[declared]
    assert per_mixer.config.tie_word_embeddings == PARAMETRIZATIONS[declared].tied
    a, b = per_mixer.state_dict(), named.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mixer", MIXERS.names())
@pytest.mark.parametrize("ffn", ("dense", "moe"))
def test_init_reaches_every_parameter(mixer, ffn):
    """Every parameter is written by some init (from_pretrained leaves missing ones uninitialised)."""
    model = reinitialised_over_nan(build(mixer, ffn, d=64, layers=2, tie_word_embeddings=False,
                                         ffn_options={"moe": {"num_shared_experts": 1, "aux_free_bias": True}}))
    assert [name for name, p in model.named_parameters() if not p.isfinite().all()] == []


def test_from_pretrained_keeps_loaded_weights(tmp_path):
    """A softmax checkpoint loaded as dsa: every loaded weight is the checkpoint's, and only the missing
    indexer gets its declared init."""
    softmax = build("softmax", d=64, layers=2)
    softmax.save_pretrained(tmp_path)
    dsa, info = DecoderLM.from_pretrained(tmp_path, mixer="dsa", output_loading_info=True)
    assert info["missing_keys"] and all(".indexer." in key for key in info["missing_keys"])
    loaded = dict(softmax.named_parameters())
    for name, p in dsa.named_parameters():
        if ".indexer." in name:
            continue
        assert torch.equal(p, loaded[name]), name
    ix = dsa.layers[0].mixer.indexer
    assert_normal(torch.cat([ix.q_proj.weight.flatten(), ix.k_proj.weight.flatten()]), STD)
    assert torch.equal(ix.k_norm.weight, torch.ones_like(ix.k_norm.weight))


@torch.no_grad()
def memory_path_share(model: DecoderLM, seed: int = 0) -> float:
    """rms(C h) / rms(D x) in layer 0 of a mamba2 model on random tokens: the SSM's memory path
    against its skip path at init (the SSD without D, then D x alone)."""
    from model.ops.ssd import mamba_chunk_scan

    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(seed))
    block = model.layers[0]
    mixer = block.mixer
    x = block.mixer_norm(model.embed_tokens(ids))
    H, P, G, N = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.state_size
    _, xBC, dt = mixer.in_proj(x).split([mixer.d_inner, mixer.d_inner + 2 * G * N, H], dim=-1)
    xs, B, C = mixer.conv(xBC).split([mixer.d_inner, G * N, G * N], dim=-1)
    xs = xs.view(4, 64, H, P)
    memory = mamba_chunk_scan(xs, dt, -mixer.A_log.exp(), B.view(4, 64, G, N), C.view(4, 64, G, N),
                              mixer.chunk_size, dt_bias=mixer.dt_bias, dt_softplus=True)
    skip = mixer.D[:, None] * xs
    return (memory.pow(2).mean().sqrt() / skip.pow(2).mean().sqrt()).item()


def as_mamba_ssm(model: DecoderLM, seed: int, in_proj_std: float | None = None):
    """(ours, reference): the model re-initialised by our init, and a copy with in_proj and the conv
    as mamba_ssm leaves them, written out independently (torch's own reset_parameters) from the same
    random stream, and our dt_bias, A_log, D. in_proj_std replaces the reference's in_proj by
    N(0, in_proj_std), what the generic init used to do."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for i, (ours, theirs) in enumerate(zip(model.layers, ref.layers)):
            torch.manual_seed(seed + i)
            ours.mixer.init_parameters()
            torch.manual_seed(seed + i)
            theirs.mixer.in_proj.reset_parameters()
            theirs.mixer.conv.conv.reset_parameters()
            if in_proj_std is not None:
                torch.nn.init.normal_(theirs.mixer.in_proj.weight, std=in_proj_std)
            for name in ("dt_bias", "A_log", "D"):
                getattr(theirs.mixer, name).copy_(getattr(ours.mixer, name))
    return model, ref


@pytest.mark.parametrize("d", (64, 128))
def test_mamba2_memory_path_at_least_mamba_ssm(d):
    shares = {"ours": [], "mamba_ssm": [], "generic": []}
    for seed in range(4):
        ours, ref = as_mamba_ssm(build("mamba2", d=d, layers=2, seed=seed), seed)
        _, generic = as_mamba_ssm(build("mamba2", d=d, layers=2, seed=seed), seed, in_proj_std=STD)
        shares["ours"].append(memory_path_share(ours, seed))
        shares["mamba_ssm"].append(memory_path_share(ref, seed))
        shares["generic"].append(memory_path_share(generic, seed))
    ours, ref, generic = (np.mean(v) for v in shares.values())
    assert ours >= ref * (1 - 1e-5), shares
    assert generic < 0.9 * ours, shares  # the generic N(0, 0.02) in_proj starts the memory path weaker


def tiny_mqar_run(mixer: str, seed: int, ids: torch.Tensor, labels: torch.Tensor, vocab: int) -> tuple[float, float]:
    """(query loss, accuracy) on the last 256 sequences after 150 AdamW steps of 32 on the first 2048."""
    adamw = OmegaConf.load(CONFIG_DIR / "optimizer" / "adamw.yaml")
    torch.manual_seed(seed)
    model = DecoderLM(LMConfig(vocab_size=vocab, hidden_size=128, num_hidden_layers=2,
                               num_attention_heads=2, max_position_embeddings=ids.shape[1], mixer=mixer,
                               mixer_options={"mamba2": {"head_dim": 16, "state_size": 16, "chunk_size": 16},
                                              "gdn": {"chunk_size": 16}}))
    lr = OmegaConf.load(CONFIG_DIR / "mixer" / f"{mixer}.yaml").lr.adamw
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(adamw.betas), weight_decay=adamw.weight_decay)
    order = torch.randperm(2048, generator=torch.Generator().manual_seed(seed + 1))
    for step in range(150):
        rows = order[(step * 32) % 2048:][:32]
        loss = model(ids[rows], labels=labels[rows]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        out = model(ids[-256:], labels=labels[-256:])
        target = labels[-256:, 1:]
        mask = target != -100
        acc = (out.logits[:, :-1].argmax(-1)[mask] == target[mask]).float().mean().item()
    return out.loss.item(), acc


@pytest.mark.slow  # 15-45 s each: trains the recurrent mixer on MQAR, up to 3 times
@pytest.mark.parametrize("mixer", ["mamba2", "gdn", "derived_gdn"])
def test_recurrent_mixers_leave_chance_on_tiny_mqar(mixer):
    """2 layers, d 128, 4 pairs in 32 tokens, 16 values: at chance the query loss is ln 16. Each recurrent
    mixer at its default AdamW lr (trainer.lr's default under optimizer=adamw: lr.adamw in its
    configs/mixer file) must get well below it, and above chance accuracy, within 150 steps, in one of 3
    seeds: at this size a single seed of gdn can stay near chance under either short-conv start (fla's
    N(0, 0.02), the default, or nn.Conv1d's uniform; docs/studies/gdn_language.md), and a broken init fails all."""
    V, S, n = 32, 32, 4
    ids, labels = (torch.from_numpy(a) for a in mqar_slice(2304, S, n, V, 0.01, np.random.Generator(np.random.PCG64(0))))
    chance, runs = math.log(V // 2), []
    for seed in range(3):
        runs.append(tiny_mqar_run(mixer, seed, ids, labels, V))
        loss, acc = runs[-1]
        if loss < chance - 0.3 and acc > 2 / (V // 2):
            return
    pytest.fail(f"{mixer} stayed near chance ({chance:.3f}) in every seed: (query loss, accuracy) {runs}")
