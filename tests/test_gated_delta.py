"""model/ops/gated_delta (chunked, recurrent, derived) against per-token recurrences written straight from the formulas (float64)."""
import pytest
import torch
import torch.nn.functional as F

import model.ops.gated_delta.chunk as gated_delta
from model.ops.gated_delta.decayed_products import _decayed_products
from conftest import assert_bf16_rounding_of
from model.ops.gated_delta import (chunk_gated_delta_rule, derived_gated_delta_rule, fused_recurrent_gated_delta_rule,
                                   naive_derived_gated_delta, naive_gated_delta)

f64 = torch.float64


DECAYS = ("per_head", "per_channel", "none")  # g [B, T, H] (GDN), [B, T, H, K] (KDA), None (DeltaNet)


def make_inputs(B=2, T=37, H=3, K=8, V=6, dtype=f64, seed=0, decay="per_head", max_beta=1.0):
    """max_beta=2: beta in (0, 2), the transitions' negative eigenvalues (allow_neg_eigval)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, *(K,) * (decay == "per_channel"), generator=gen, dtype=dtype))
    beta = max_beta * torch.rand(B, T, H, generator=gen, dtype=dtype)
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    return q, k, v, None if decay == "none" else g, beta, h0


@pytest.mark.parametrize("max_beta", [1.0, 2.0])
@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])  # per channel: 2 sub-blocks of 8, 4, and 37 of one token
def test_chunk_matches_recurrence(with_state, chunk_size, decay, max_beta):
    q, k, v, g, beta, h0 = make_inputs(decay=decay, max_beta=max_beta)  # T = 37: not a multiple of the chunk
    h0 = h0 if with_state else None
    o_ref, h_ref = naive_gated_delta(q, k, v, g, beta, scale=0.3, h=h0)
    o, h = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True,
                                  chunk_size=chunk_size)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-10)
    o, h = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=h0, chunk_size=chunk_size)
    assert h is None


# one sub-block, four, three (4 | 12), 7, the CPU default's four of 8, and 37 of one token (no pair inside one)
@pytest.mark.parametrize("C, block", [(16, 16), (16, 4), (12, 8), (7, 16), (32, 8), (37, 8)])
@pytest.mark.parametrize("wide", ["all", "some", "none"])
def test_decayed_products_match_the_direct_sum(C, block, wide, monkeypatch):
    """The per-channel intra-chunk products, P_ij = sum_d a_id b_jd exp(G_id - G_jd) (i >= j), and their gradients,
    against the direct sum over channels: chunks (rows) whose decay spans past the factored path's bound (`wide`:
    every row, half of them, none) decay so strongly that exp(-G) would overflow in float64 (the sub-block path),
    the others take the factored path."""
    monkeypatch.setattr(gated_delta, "SUB_BLOCK", block)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(2, 3, C, 5, generator=gen, dtype=f64).requires_grad_() for _ in range(2))
    g = F.logsigmoid(torch.randn(2, 3, C, 5, generator=gen, dtype=f64))
    g[{"all": slice(None), "some": 1, "none": slice(0)}[wide], ..., 0] = -200.0  # G reaches -200 C
    G = g.cumsum(-2).requires_grad_()
    got = _decayed_products(a, b, G, gated_delta.sub_block(C))
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    gamma = torch.where(lower[..., None], G[..., :, None, :] - G[..., None, :, :], float("-inf")).exp()
    want = (a[..., :, None, :] * gamma * b[..., None, :, :]).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    w = torch.randn(want.shape, generator=gen, dtype=f64)
    for x, y in zip(torch.autograd.grad((got * w).sum(), (a, b, G)), torch.autograd.grad((want * w).sum(), (a, b, G))):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("span", [79.0, 81.0])  # either side of the factored path's bound, 2 MAX_EXPONENT = 80
def test_decayed_products_near_the_bound_in_fp32(span):
    """float32 products and gradients against float64 where one channel's decay spans just below the factored path's
    bound (its factors reach e^{+-39.5}, the dropped pairs e^79) and just above it (the sub-block path)."""
    gen = torch.Generator().manual_seed(0)
    C = 32
    a, b = (torch.randn(4, C, 8, generator=gen, dtype=f64) for _ in range(2))
    g = F.logsigmoid(torch.randn(4, C, 8, generator=gen, dtype=f64))
    g[:, 1:, 3] = -span / (C - 1)
    G = g.cumsum(-2)
    w = torch.randn(4, C, C, generator=gen, dtype=f64)
    results = []
    for dtype in (torch.float32, f64):
        x = [t.to(dtype).requires_grad_() for t in (a, b, G)]
        P = _decayed_products(*x, 8)
        results.append([P, *torch.autograd.grad((P * w.to(dtype)).sum(), x)])
    for got, want in zip(*results):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_per_channel_rows_past_the_factored_span_match_the_recurrence(monkeypatch):
    """A head decaying at -30 per step in one channel (a chunk of 8 spans 210, past the factored path's bound: the
    sub-block path) beside heads decaying mildly (the factored path): outputs, final states and gradients."""
    monkeypatch.setattr(gated_delta, "SUB_BLOCK", 4)
    q, k, v, g, beta, h0 = make_inputs(T=21, decay="per_channel")
    g[:, :, 1, 2] = -30.0
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    w_o, w_h = (torch.randn(*s, generator=torch.Generator().manual_seed(1), dtype=f64) for s in ((2, 21, 3, 6),
                                                                                                  (2, 3, 8, 6)))

    def loss(o, h):
        return (o * w_o).sum() + (h * w_h).sum()

    ref = naive_gated_delta(q, k, v, g, beta, h=h0)
    got = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=8)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)
    for name, a, r in zip("q k v g beta h0".split(), torch.autograd.grad(loss(*got), inputs),
                          torch.autograd.grad(loss(*ref), inputs)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9, msg=f"grad {name}")


def test_decay_forms_differ():
    """The three forms are three recurrences (a per-channel decay is not read as its mean or first channel):
    the same q, k, v, beta give outputs apart by far more than the tolerance above."""
    q, k, v, g, beta, _ = make_inputs(decay="per_channel")
    outs = [chunk_gated_delta_rule(q, k, v, decay, beta, chunk_size=16)[0] for decay in (g, g[..., 0], None)]
    assert min((a - b).abs().max() for i, a in enumerate(outs) for b in outs[i + 1:]) > 1e-2


def test_bad_decay_shape_is_one_line():
    q, k, v, g, beta, _ = make_inputs(decay="per_channel")
    with pytest.raises(ValueError, match=r"^g of shape \(2, 37, 3, 4\); valid: None, \(2, 37, 3\) .*\(2, 37, 3, 8\)"):
        chunk_gated_delta_rule(q, k, v, g[..., :4], beta)


@pytest.mark.parametrize("decay", DECAYS[:2])
def test_strong_decay_is_stable(decay):
    # Cumulative log decay far below fp32 exp range within one chunk (-20 per step): no inf/nan.
    q, k, v, g, beta, _ = make_inputs(T=64, dtype=torch.float32, decay=decay)
    g = torch.full_like(g, -20.0)
    if decay == "per_channel":  # channels that decay hard beside channels that keep their memory
        g[..., ::2] = -0.01
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    o_ref, _ = naive_gated_delta(*(x.double() for x in (q, k, v, g, beta)))
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("decay, max_beta", [("per_head", 1.0), ("per_channel", 1.0), ("none", 1.0),
                                             ("per_channel", 2.0), ("none", 2.0)])
@pytest.mark.parametrize("T", [21, 24])  # a partial last chunk of 8, and whole chunks only
def test_gradients_match_recurrence(T, decay, max_beta, monkeypatch):
    monkeypatch.setattr(gated_delta, "SUB_BLOCK", 4)
    q, k, v, g, beta, h0 = make_inputs(T=T, decay=decay, max_beta=max_beta)
    names, inputs = zip(*((n, x.requires_grad_()) for n, x in zip("q k v g beta h0".split(), (q, k, v, g, beta, h0))
                          if x is not None))
    gen = torch.Generator().manual_seed(1)
    w_o, w_h = torch.randn(2, T, 3, 6, generator=gen, dtype=f64), torch.randn(2, 3, 8, 6, generator=gen, dtype=f64)

    def loss(fn, **kw):
        o, h = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
        return (o * w_o).sum() + (h * w_h).sum()

    ref = torch.autograd.grad(loss(lambda *a, initial_state, output_final_state: naive_gated_delta(*a, h=initial_state)),
                              inputs)
    got = torch.autograd.grad(loss(chunk_gated_delta_rule, chunk_size=8), inputs)  # per channel: 2 sub-blocks of 4
    for name, a, b in zip(names, got, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"grad {name}")


@pytest.mark.parametrize("decay", DECAYS)
def test_split_sequence_carries_state(decay):
    q, k, v, g, beta, h0 = make_inputs(T=50, decay=decay)
    o, h = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    o1, h1 = chunk_gated_delta_rule(*(None if x is None else x[:, :19] for x in (q, k, v, g, beta)), initial_state=h0,
                                    output_final_state=True, chunk_size=16)
    o2, h2 = chunk_gated_delta_rule(*(None if x is None else x[:, 19:] for x in (q, k, v, g, beta)), initial_state=h1,
                                    output_final_state=True, chunk_size=16)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h2, h, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("decay", DECAYS)
def test_fused_recurrent_matches_chunk(decay):
    q, k, v, g, beta, h0 = make_inputs(T=13, decay=decay, max_beta=2.0)
    o, h = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=4)
    o_r, h_r = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o_r, o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h_r, h, rtol=1e-10, atol=1e-10)


def test_low_precision_input_accumulates_in_fp32():
    """bf16 q, k, v over 256 slowly decaying steps: the output is the float64 recurrence of the same
    bf16 values rounded once to bf16, which the recurrence run in bf16 is not; the state stays fp32."""
    q, k, v, _, beta, _ = (x.float() for x in make_inputs(B=1, T=256, H=2, K=16, V=16))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    g = -0.02 * torch.rand(beta.shape, generator=torch.Generator().manual_seed(1))  # a long memory
    ref, _ = naive_gated_delta(q.double(), k.double(), v.double(), g.double(), beta.double())
    o16, h16 = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, output_final_state=True)
    assert o16.dtype == torch.bfloat16 and h16.dtype == torch.float32
    assert_bf16_rounding_of(o16, ref)
    bf16, _ = naive_gated_delta(q, k, v, g.bfloat16(), beta.bfloat16())
    with pytest.raises(AssertionError):  # accumulating in bf16 fails at this size
        assert_bf16_rounding_of(bf16, ref)


@pytest.mark.parametrize("scale", [None, 1.0, 0.1])
def test_derived_matches_recursion(scale):
    q, k, v = (x * 2 for x in make_inputs(T=45, K=8, V=8)[:3])  # starts at t = 1
    o_ref, (A, k_sum, v_sum, t) = naive_derived_gated_delta(q, k, v, scale=scale)
    o, state = derived_gated_delta_rule(q, k, v, scale=scale, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(o[:, 0], v[:, 0])  # t = 1: A_1 = 0, o_1 = v_1
    torch.testing.assert_close(state["A"], A.transpose(-1, -2), rtol=1e-9, atol=1e-9)
    s = (8 ** -0.5 if scale is None else scale) ** 0.5
    torch.testing.assert_close(state["k_sum"], (k * s).sum(1))
    torch.testing.assert_close(state["v_sum"], v.sum(1))
    assert state["t"] == t == 45


def test_derived_continuation_across_split():
    q, k, v = make_inputs(T=80, K=8, V=8)[:3]
    o, state = derived_gated_delta_rule(q, k, v, output_final_state=True)
    o1, s1 = derived_gated_delta_rule(q[:, :33], k[:, :33], v[:, :33], output_final_state=True)
    o2, s2 = derived_gated_delta_rule(q[:, 33:], k[:, 33:], v[:, 33:], initial_state=s1, output_final_state=True)
    o3, s3 = derived_gated_delta_rule(q[:, 33:34], k[:, 33:34], v[:, 33:34], initial_state=s1, output_final_state=True)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(o3, o[:, 33:34], rtol=1e-10, atol=1e-10)  # single-token decode step
    for key in ("A", "k_sum", "v_sum"):
        torch.testing.assert_close(s2[key], state[key], rtol=1e-10, atol=1e-10)
    assert s2["t"] == 80 and s3["t"] == 34


@pytest.mark.parametrize("clamp", [False, True])
def test_derived_gradients_match_recursion(clamp):
    q, k, v = make_inputs(T=20, K=8, V=8)[:3]
    inputs = [x.requires_grad_() for x in (q, k * 4, v)]  # |k s|^2 ~ 5.6: the clamp acts early on
    w = torch.randn(2, 20, 3, 8, dtype=f64)
    ref = torch.autograd.grad((naive_derived_gated_delta(*inputs, clamp=clamp)[0] * w).sum(), inputs)
    got = torch.autograd.grad((derived_gated_delta_rule(*inputs, clamp_ktil=clamp)[0] * w).sum(), inputs)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_derived_large_keys_float32():
    """Keys with |ktil_t|^2 > 2t - 1 give transition eigenvalues 1 - (1 + |ktil|^2)/t below -1: the exact
    recursion amplifies the state. The float32 op still follows the float64 recursion (it is exact, the
    growth is the formula's), until the growth leaves float32's range; clamp_ktil bounds it."""
    q, _, v = make_inputs(T=70, H=2, K=16, V=16)[:3]
    k = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=f64)  # |k s|^2 ~ 4 mag^2
    for mag, clamp in [(6.0, False), (30.0, True)]:
        o_ref, _ = naive_derived_gated_delta(q, k * mag, v, clamp=clamp)
        o32, _ = derived_gated_delta_rule(q.float(), (k * mag).float(), v.float(), clamp_ktil=clamp)
        assert (o32.double() - o_ref).norm() / o_ref.norm() < 1e-4
        if not clamp:
            assert o_ref.abs().max() > 1e6  # amplified by the exact recursion
        else:
            assert o32.abs().max() < 10 * v.abs().max()  # bounded: no step amplifies
    o_big, _ = derived_gated_delta_rule(q.float(), (k * 30.0).float(), v.float())
    assert not torch.isfinite(o_big).all()  # the exact recursion leaves float32's range
