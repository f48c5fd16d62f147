"""The delta-rule mixers (every registered DeltaRuleBlock: deltanet, gdn, kda, gdn2, deltaproduct) and
allow_neg_eigval on each, inside a tiny DecoderLM: decoding with the cache reproduces the full forward, with and
without negative eigenvalues; the op receives the decay each mixer declares (none, per head, per key channel) and
beta (GDN-2: its erase gate) in (0, 2) with the option on; KDA's, GDN-2's and DeltaProduct's gates and init follow
their references."""
import pytest
import torch
import torch.nn.functional as F
from conftest import reinitialised_over_nan
from test_mixer_gdn import decode_steps, randomise, tiny_model

import model.mixers.delta_rule as delta_rule_mixer
import model.mixers.deltaproduct as deltaproduct_mixer
from model.mixers.delta_rule import DeltaRuleBlock
from model.registry import MIXERS

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes

FAMILY = [name for name in MIXERS.names() if issubclass(MIXERS.get(name), DeltaRuleBlock)]
# g handed to the op: None, [B, T, H], [B, T, H, K]
DECAY_DIMS = {"deltanet": None, "gdn": 3, "kda": 4, "gdn2": 4, "deltaproduct": 3}


def test_every_delta_rule_mixer_declares_its_decay():
    assert sorted(DECAY_DIMS) == FAMILY


@pytest.fixture
def op_calls(monkeypatch):
    """(g's dim or None, max beta) of every chunked and recurrent call the mixers make."""
    calls = []
    for module, name in ((delta_rule_mixer, "chunk_gated_delta_rule"),
                         (delta_rule_mixer, "fused_recurrent_gated_delta_rule"),
                         (deltaproduct_mixer, "chunk_gated_delta_product"),
                         (deltaproduct_mixer, "fused_recurrent_gated_delta_product")):
        op = getattr(module, name)

        def spy(q, k, v, g, beta, *args, op=op, **kwargs):
            calls.append((None if g is None else g.dim(), beta.max().item()))
            return op(q, k, v, g, beta, *args, **kwargs)
        monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("neg", [False, True], ids=["beta01", "neg_eigval"])
@pytest.mark.parametrize("prefill", [0, 11])
@pytest.mark.parametrize("mixer", FAMILY)
def test_decoding_matches_full_forward(mixer, prefill, neg, op_calls):
    model = tiny_model(mixer, **{mixer: {"chunk_size": 8, "allow_neg_eigval": neg}})
    randomise(model)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "b_proj"):
                m.b_proj.weight.mul_(100)  # beta's logits of order one: beta spans (0, 1) or (0, 2)
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        torch.testing.assert_close(decode_steps(model, ids, prefill), full, rtol=0, atol=1e-4)
    dims, betas = zip(*op_calls)
    assert set(dims) == {DECAY_DIMS[mixer]} and len(dims) == 2 * (21 - prefill + (prefill > 0) + 1)
    assert (1.2 < max(betas) <= 2) if neg else (max(betas) <= 1)


@pytest.mark.parametrize("mixer", FAMILY)
def test_neg_eigval_changes_the_model(mixer):
    """Same weights, the option on and off: different logits (beta doubled), so the option reaches the op."""
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = (tiny_model(mixer, **{mixer: {"allow_neg_eigval": neg}})(ids).logits for neg in (False, True))
    assert (a - b).abs().max() > 1e-3


def test_kda_gate_init_and_options():
    mixer = tiny_model("kda").layers[0].mixer
    A, dt = mixer.A_log.exp(), F.softplus(mixer.dt_bias)
    assert ((A >= 1) & (A <= 16)).all() and ((dt >= 1e-3 - 1e-7) & (dt <= 1e-1 + 1e-7)).all()
    assert mixer.dt_bias.shape == (mixer.num_v_heads * mixer.head_dim,) and mixer.head_v_dim == mixer.head_dim
    assert mixer.f_proj[0].out_features == mixer.g_proj[0].out_features == mixer.head_v_dim  # low rank d_v
    assert (mixer.g_proj[1].bias == 0).all()
    x = torch.randn(2, 5, 64)
    g = mixer.decay(x)
    assert g.shape == (2, 5, mixer.num_v_heads, mixer.head_dim) and (g < 0).all()
    f = mixer.f_proj(x).view(2, 5, mixer.num_v_heads, -1) + mixer.dt_bias.view(mixer.num_v_heads, -1)
    torch.testing.assert_close(g, -A[:, None] * F.softplus(f))
    bounded = tiny_model("kda", kda={"lower_bound": -5.0}).layers[0].mixer
    assert (bounded.A_log == 0).all()
    with torch.no_grad():
        bounded.dt_bias.copy_(torch.linspace(-30, 30, len(bounded.dt_bias)))  # saturating both ways, never past
    g = bounded.decay(x)
    f = bounded.f_proj(x).view(g.shape) + bounded.dt_bias.view(g.shape[2:])
    torch.testing.assert_close(g, -5 * torch.sigmoid(f))  # A_log = 0: exp(A_log) = 1
    assert ((g >= -5) & (g <= 0)).all() and g.min() < -4.99 and g.max() > -0.01
    with pytest.raises(ValueError, match=r"^kda lower_bound=1.0; valid: a negative number or null$"):
        tiny_model("kda", kda={"lower_bound": 1.0})


def test_deltanet_has_no_decay_or_gate():
    names = {n for n, _ in tiny_model("deltanet").layers[0].mixer.named_parameters()}
    assert not {n for n in names if n.startswith(("A_log", "dt_bias", "a_proj", "g_proj", "f_proj"))}
    assert "o_norm.weight" in names


def test_per_channel_decay_counts_the_scalar_decays_matmuls():
    """Per token, whatever the length (whole chunks); and, with the decay per key channel, the scalar decay's matmul
    FLOPs at the same widths: decayed_products.py runs k k^T and q k^T as whole matmuls through the channels' mid
    decay (tests/test_flops.py checks both against counted matmuls)."""
    kda, gdn = (tiny_model(m, **{m: {"expand_v": 1}}).layers[0].mixer for m in ("kda", "gdn"))
    assert kda.flops_per_token(1024, "cpu") == kda.flops_per_token(8192, "cpu") > 0
    core = [m.flops_per_token(1024, "cpu") - m.flops_per_token(1, "cpu") for m in (kda, gdn)]  # the chunked terms alone
    assert 0 < core[0] == core[1]


def test_gdn2_gates_and_decay_per_qk_head():
    """GDN-2 (fla's GatedDeltaNet2): erase b = sigmoid(W_b x) per q/k head and key channel (doubled with
    allow_neg_eigval), write w = sigmoid(W_w x) per value channel (never doubled), the decay per q/k head and key
    channel; all repeated to the value heads (num_v_heads = 4 over 2 q/k heads)."""
    for neg in (False, True):
        mixer = tiny_model("gdn2", gdn2={"num_v_heads": 4, "allow_neg_eigval": neg}).layers[0].mixer
        x = torch.randn(2, 5, 64)
        erase, write = mixer.gates(x)
        H, Hv, K, V = mixer.num_heads, mixer.num_v_heads, mixer.head_dim, mixer.head_v_dim
        b = torch.sigmoid(mixer.b_proj(x)).view(2, 5, H, K).repeat_interleave(Hv // H, 2) * (2 if neg else 1)
        torch.testing.assert_close(erase, b)
        torch.testing.assert_close(write, torch.sigmoid(mixer.w_proj(x)).view(2, 5, Hv, V))
        g = mixer.decay(x)
        f = mixer.f_proj(x).view(2, 5, H, K) + mixer.dt_bias.view(H, K)
        want = (-mixer.A_log.exp()[:, None] * F.softplus(f)).repeat_interleave(Hv // H, 2)
        torch.testing.assert_close(g, want)


def test_deltaproduct_steps_per_token():
    """num_householder = n: W_k, W_v, W_b and the k, v convs n times as wide; the op gets k, v, beta of T n steps,
    a token's n consecutive, and n = 1 is Gated DeltaNet itself (same weights, same logits)."""
    mixer = tiny_model("deltaproduct", deltaproduct={"num_householder": 3}).layers[0].mixer
    assert (mixer.k_proj.out_features, mixer.v_proj.out_features, mixer.b_proj.out_features) == (
        3 * mixer.key_dim, 3 * mixer.value_dim, 3 * mixer.num_v_heads)
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(2))
    one, gdn = tiny_model("deltaproduct", deltaproduct={"num_householder": 1}), tiny_model("gdn")
    gdn.load_state_dict(one.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(one(ids).logits, gdn(ids).logits, rtol=0, atol=1e-5)


STATE_TRACKING_FORM = {"num_householder": 2, "allow_neg_eigval": True, "use_short_conv": False,
                       "use_forget_gate": False, "use_output_gate": False, "chunk_size": 8}


def test_deltaproduct_state_tracking_form(op_calls):
    """use_short_conv, use_forget_gate and use_output_gate off (DeltaProduct's state-tracking model): no convs, decay
    or gate parameters, q = silu(W_q x) and y = W_o RMSNorm(o); the op gets no decay; init reaches every parameter;
    decoding equals the full forward and a packed row its documents alone."""
    model = tiny_model("deltaproduct", deltaproduct=STATE_TRACKING_FORM)
    mixer = model.layers[0].mixer
    assert {n for n, _ in mixer.named_parameters()} == {f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "b_proj",
                                                                                 "o_proj", "o_norm")}
    assert all(p.isfinite().all() for p in reinitialised_over_nan(model).parameters())
    o = torch.randn(2, 5, mixer.num_v_heads, mixer.head_v_dim)
    torch.testing.assert_close(mixer.normalize(o, torch.randn(2, 5, 64)), mixer.o_norm(o))
    randomise(model)
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3]] * 2)
    with torch.no_grad():
        full = model(ids).logits
        torch.testing.assert_close(decode_steps(model, ids, 11), full, rtol=0, atol=1e-4)
        packed = model(ids, position_ids=positions).logits
        for start, end in ((0, 7), (7, 17), (17, 21)):
            torch.testing.assert_close(packed[:, start:end], model(ids[:, start:end]).logits, rtol=0, atol=1e-4)
    assert {dims for dims, _ in op_calls} == {None}
