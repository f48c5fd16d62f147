"""GDN-2's gates and Gated DeltaProduct's steps (model/ops/gated_delta) against their per-token recurrences written
from the papers (float64): chunked and recurrent forms, lengths not a multiple of the chunk, initial and final states,
packed sequences, gradients; and GDN-2 with b = w = beta equal to KDA, op and mixer."""
import pytest
import torch
import torch.nn.functional as F

import model.ops.gated_delta.chunk as chunk
from model.config import LMConfig
from model.ops.gated_delta import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, naive_gated_delta
from model.ops.gated_delta.naive import naive_gated_delta_product
from model.ops.gated_delta.product import chunk_gated_delta_product, fused_recurrent_gated_delta_product
from model.registry import MIXERS

f64 = torch.float64


def gdn2_inputs(B=2, T=37, H=3, K=8, V=6, decay="per_channel", max_erase=1.0, seed=0):
    """q, k, v, g, erase b [B, T, H, K] in (0, max_erase), write w [B, T, H, V] in (0, 1), h0."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=f64)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=f64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=f64)
    g = F.logsigmoid(torch.randn(B, T, H, *(K,) * (decay == "per_channel"), generator=gen, dtype=f64))
    erase = max_erase * torch.rand(B, T, H, K, generator=gen, dtype=f64)
    write = torch.rand(B, T, H, V, generator=gen, dtype=f64)
    return q, k, v, None if decay == "none" else g, erase, write, torch.randn(B, H, K, V, generator=gen, dtype=f64)


def product_inputs(n, B=2, T=23, H=3, K=8, V=6, decay=True, max_beta=1.0, seed=0):
    """q [B, T, ...]; k, v, beta [B, T n, ...] (a token's n steps consecutive); g [B, T, H] or None; h0."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=f64)
    k = F.normalize(torch.randn(B, T * n, H, K, generator=gen, dtype=f64), dim=-1)
    v = torch.randn(B, T * n, H, V, generator=gen, dtype=f64)
    beta = max_beta * torch.rand(B, T * n, H, generator=gen, dtype=f64)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=f64)) if decay else None
    return q, k, v, g, beta, torch.randn(B, H, K, V, generator=gen, dtype=f64)


@pytest.mark.parametrize("decay", ["per_channel", "per_head", "none"])
@pytest.mark.parametrize("max_erase", [1.0, 2.0])
@pytest.mark.parametrize("chunk_size", [8, 16])  # T = 37: a partial last chunk
def test_gdn2_chunk_and_recurrent_match_the_papers_recurrence(decay, max_erase, chunk_size):
    q, k, v, g, b, w, h0 = gdn2_inputs(decay=decay, max_erase=max_erase)
    o_ref, h_ref = naive_gated_delta(q, k, v, g, b, scale=0.3, h=h0, write=w)
    for run in (lambda: chunk_gated_delta_rule(q, k, v, g, b, scale=0.3, initial_state=h0, output_final_state=True,
                                               chunk_size=chunk_size, write=w),
                lambda: fused_recurrent_gated_delta_rule(q, k, v, g, b, scale=0.3, initial_state=h0,
                                                         output_final_state=True, write=w)):
        o, h = run()
        torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-10)


def test_gdn2_gradients_match_the_recurrence(monkeypatch):
    monkeypatch.setattr(chunk, "SUB_BLOCK", 4)
    q, k, v, g, b, w, h0 = gdn2_inputs(T=21, max_erase=2.0)
    inputs = [x.requires_grad_() for x in (q, k, v, g, b, w, h0)]
    gen = torch.Generator().manual_seed(1)
    w_o, w_h = torch.randn(2, 21, 3, 6, generator=gen, dtype=f64), torch.randn(2, 3, 8, 6, generator=gen, dtype=f64)

    def loss(o, h):
        return (o * w_o).sum() + (h * w_h).sum()

    ref = torch.autograd.grad(loss(*naive_gated_delta(q, k, v, g, b, h=h0, write=w)), inputs)
    got = torch.autograd.grad(loss(*chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                           chunk_size=8, write=w)), inputs)
    for name, a, r in zip("q k v g erase write h0".split(), got, ref):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9, msg=f"grad {name}")


def test_gdn2_packed_sequences_restart():
    q, k, v, g, b, w, _ = gdn2_inputs(B=1, T=40)
    cu = torch.tensor([0, 9, 30, 40])
    o, h = chunk_gated_delta_rule(q, k, v, g, b, cu_seqlens=cu, output_final_state=True, chunk_size=8, write=w)
    for i, (a, e) in enumerate(zip(cu.tolist(), cu[1:].tolist())):
        o_ref, h_ref = naive_gated_delta(*(x[:, a:e] for x in (q, k, v, g, b)), write=w[:, a:e])
        torch.testing.assert_close(o[:, a:e], o_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(h[i:i + 1], h_ref, rtol=1e-10, atol=1e-10)


def test_gdn2_with_equal_gates_is_kda():
    """b = w = beta (the scalar spread over the channels) is the delta rule with KDA's decay: the paper's recurrence
    against the delta rule's own (u = beta (v - h^T k))."""
    q, k, v, g, b, _, h0 = gdn2_inputs(max_erase=2.0)
    beta = b[..., 0]
    gates = dict(write=beta[..., None].expand(v.shape))
    o_kda, h_kda = naive_gated_delta(q, k, v, g, beta, h=h0)
    for o, h in (naive_gated_delta(q, k, v, g, beta[..., None].expand(k.shape), h=h0, **gates),
                 chunk_gated_delta_rule(q, k, v, g, beta[..., None].expand(k.shape), initial_state=h0,
                                        output_final_state=True, chunk_size=16, **gates)):
        torch.testing.assert_close(o, o_kda, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(h, h_kda, rtol=1e-10, atol=1e-10)


def test_gdn2_mixer_with_kdas_weights_and_tied_gates_is_kda():
    """The gdn2 mixer whose erase and write rows all copy KDA's beta row for their head (b = w = beta), every other
    weight KDA's, gives KDA's output, float32 (its beta per value head: num_v_heads = num_heads here). Not with
    allow_neg_eigval: GDN-2 doubles the erase gate only, KDA its one beta, which also writes."""
    config = LMConfig(hidden_size=32, num_attention_heads=2, mixer_options={"kda": {"expand_v": 1}})
    torch.manual_seed(0)
    kda, gdn2 = MIXERS.get("kda")(config), MIXERS.get("gdn2")(config)
    for layer in (kda, gdn2):
        layer.init_parameters()
    state = {name: p for name, p in kda.state_dict().items() if name != "b_proj.weight"}
    gdn2.load_state_dict(state, strict=False)
    per_head = kda.b_proj.weight.detach()  # [H, d]
    with torch.no_grad():
        gdn2.b_proj.weight.copy_(per_head.repeat_interleave(gdn2.head_dim, 0))
        gdn2.w_proj.weight.copy_(per_head.repeat_interleave(gdn2.head_v_dim, 0))
    x = torch.randn(2, 45, 32)
    torch.testing.assert_close(gdn2(x), kda(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("decay, max_beta", [(True, 1.0), (True, 2.0), (False, 2.0)])
def test_deltaproduct_matches_its_recurrence(n, decay, max_beta):
    q, k, v, g, beta, h0 = product_inputs(n, decay=decay, max_beta=max_beta)  # T = 23, chunk 16 steps
    o_ref, h_ref = naive_gated_delta_product(q, k, v, g, beta, n, scale=0.3, h=h0)
    for run in (chunk_gated_delta_product, fused_recurrent_gated_delta_product):
        o, h = run(q, k, v, g, beta, n, scale=0.3, initial_state=h0, output_final_state=True,
                   **({"chunk_size": 16} if run is chunk_gated_delta_product else {}))
        torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-10)


def test_deltaproduct_gradients_and_packing():
    n = 2
    q, k, v, g, beta, h0 = product_inputs(n, T=19, max_beta=2.0)
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    w_o = torch.randn(2, 19, 3, 6, dtype=f64)
    ref = torch.autograd.grad((naive_gated_delta_product(q, k, v, g, beta, n, h=h0)[0] * w_o).sum(), inputs)
    got = torch.autograd.grad((chunk_gated_delta_product(q, k, v, g, beta, n, initial_state=h0, chunk_size=8)[0]
                               * w_o).sum(), inputs)
    for name, a, r in zip("q k v g beta h0".split(), got, ref):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9, msg=f"grad {name}")
    cu = torch.tensor([0, 5, 19])  # tokens; the op cuts the steps at n times these
    o, h = chunk_gated_delta_product(*(x[:1].detach() for x in (q, k, v, g, beta)), n, cu_seqlens=cu,
                                     output_final_state=True, chunk_size=8)
    for i, (a, e) in enumerate(zip(cu.tolist(), cu[1:].tolist())):
        o_ref, h_ref = naive_gated_delta_product(q[:1, a:e], k[:1, a * n:e * n], v[:1, a * n:e * n], g[:1, a:e],
                                                 beta[:1, a * n:e * n], n)
        torch.testing.assert_close(o[:, a:e], o_ref.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(h[i:i + 1], h_ref.detach(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n, chunk_size", [(2, 8), (3, 8), (3, 16)])  # chunks of 8, 6, 15 steps
def test_deltaproduct_query_rows_alone(n, chunk_size):
    """The chunked op's output side at the query rows alone (query_every = n): outputs, final states and every
    gradient (h0's too) as the recurrence's, alone (13 tokens, a partial last chunk) and packed (5 + 8 tokens);
    a decay per key channel takes the queries spread over the steps instead."""
    q, k, v, g, beta, h0 = product_inputs(n, T=13, max_beta=2.0, seed=n)
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    w_o, w_h = torch.randn(2, 13, 3, 6, dtype=f64), torch.randn(2, 3, 8, 6, dtype=f64)

    def loss(o, h):
        return (o * w_o[:o.shape[0]]).sum() + (h * w_h[:h.shape[0]]).sum()

    o_ref, h_ref = naive_gated_delta_product(q, k, v, g, beta, n, scale=0.3, h=h0)
    o, h = chunk_gated_delta_product(q, k, v, g, beta, n, scale=0.3, initial_state=h0, output_final_state=True,
                                     chunk_size=chunk_size)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-10)
    for name, a, r in zip("q k v g beta h0".split(), torch.autograd.grad(loss(o, h), inputs),
                          torch.autograd.grad(loss(o_ref, h_ref), inputs)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9, msg=f"grad {name}")
    cu = torch.tensor([0, 5, 13])
    row = [x[:1] for x in inputs[:5]]
    o, h = chunk_gated_delta_product(*row, n, cu_seqlens=cu, output_final_state=True, chunk_size=chunk_size)
    refs = [naive_gated_delta_product(q[:1, a:e], k[:1, a * n:e * n], v[:1, a * n:e * n], g[:1, a:e],
                                      beta[:1, a * n:e * n], n) for a, e in zip(cu.tolist(), cu[1:].tolist())]
    o_ref, h_ref = torch.cat([r[0] for r in refs], 1), torch.cat([r[1] for r in refs])
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-10)
    for name, a, r in zip("q k v g beta".split(), torch.autograd.grad(loss(o, h), inputs[:5]),
                          torch.autograd.grad(loss(o_ref, h_ref), inputs[:5])):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9, msg=f"packed grad {name}")
    g_channel = g[..., None].expand(2, 13, 3, 8).repeat_interleave(n, 1) / n  # per key channel, per step
    o = chunk_gated_delta_rule(q, k, v, g_channel, beta, chunk_size=chunk_size, query_every=n)[0]
    spread = torch.zeros(2, 13, n, 3, 8, dtype=f64)
    spread[:, :, -1] = q
    o_ref = chunk_gated_delta_rule(spread.flatten(1, 2), k, v, g_channel, beta, chunk_size=chunk_size)[0]
    torch.testing.assert_close(o, o_ref[:, n - 1::n], rtol=0, atol=0)


def test_bad_gate_shapes_are_one_line():
    q, k, v, g, b, w, _ = gdn2_inputs()
    with pytest.raises(ValueError, match=r"^an erase gate per key channel .* needs its write gate"):
        chunk_gated_delta_rule(q, k, v, g, b)
    with pytest.raises(ValueError, match=r"^write of shape \(2, 37, 3, 5\); valid: \(2, 37, 3, 6\)"):
        chunk_gated_delta_rule(q, k, v, g, b, write=w[..., :5])
    with pytest.raises(ValueError, match=r"^k of 37 steps for 37 tokens; valid: 74"):
        chunk_gated_delta_product(q, k, v, g, b[..., 0], 2)
