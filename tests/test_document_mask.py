"""Document masking (float64): a packed row equals its document segments run one by one, for every
mixer and a hybrid; each chunked op with cu_seqlens equals its per-token recurrence restarted at
every sequence (outputs, final states per sequence, gradients)."""
import pytest
import torch
import torch.nn.functional as F
from test_gated_delta import make_inputs as gdn_inputs
from test_linear_attention import make_inputs as linear_inputs
from test_ssd import make_inputs as ssd_inputs

from model.registry import MIXERS
from model import DecoderLM, LMConfig
from model.segments import DocumentSegments
from model.ops.gated_delta import (chunk_gated_delta_rule, derived_gated_delta_rule, fused_recurrent_gated_delta_rule,
                                   naive_derived_gated_delta, naive_gated_delta)
from model.ops.linear_attention import chunk_linear_attn, naive_linear_attn
from model.ops.ssd import mamba_chunk_scan, naive_ssd
from model.ops.varlen import sequence_cumsum

f64 = torch.float64
CU = torch.tensor([0, 5, 6, 20, 21, 37])  # lengths 5, 1, 14, 1, 16: none a multiple of the chunk (4)


def per_sequence(naive, cu_seqlens, tensors: dict, **kw):
    """The oracle: `naive` run on each sequence alone from a zero state; outputs concatenated in
    time, final states stacked."""
    bounds = cu_seqlens.tolist()
    parts = [naive(**{n: x[:, a:b] for n, x in tensors.items()}, **kw) for a, b in zip(bounds, bounds[1:])]
    return torch.cat([p[0] for p in parts], 1), [torch.cat([p[i] for p in parts]) for i in range(1, len(parts[0]))]


def assert_grads_match(leaves: dict, out, ref):
    """d(sum of out * w)/d leaves equals the same through ref (out, ref: lists of tensors)."""
    gen = torch.Generator().manual_seed(1)
    w = [torch.randn(o.shape, generator=gen, dtype=f64) for o in out]
    got = torch.autograd.grad(sum((o * wi).sum() for o, wi in zip(out, w)), list(leaves.values()))
    want = torch.autograd.grad(sum((r * wi).sum() for r, wi in zip(ref, w)), list(leaves.values()))
    for name, a, b in zip(leaves, got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("decay", ["per_head", "per_channel", "none"])
def test_gated_delta_cu_seqlens_matches_restarted_recurrence(decay):
    q, k, v, g, beta, _ = gdn_inputs(B=1, T=37, decay=decay, max_beta=2.0)
    leaves = {n: x.requires_grad_() for n, x in zip("q k v g beta".split(), (q, k, v, g, beta)) if x is not None}
    o_ref, (S_ref,) = per_sequence(naive_gated_delta, CU, leaves, scale=0.3, **({"g": None} if g is None else {}))
    o, S = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3, output_final_state=True, chunk_size=4, cu_seqlens=CU)
    assert S.shape == (len(CU) - 1, *S_ref.shape[1:])
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-10)
    assert_grads_match(leaves, [o, S], [o_ref, S_ref])  # through the final states of every sequence too
    o_rec, S_rec = fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.3, output_final_state=True,
                                                    cu_seqlens=CU)
    torch.testing.assert_close(o_rec, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S_rec, S_ref, rtol=1e-10, atol=1e-10)


def test_derived_cu_seqlens_matches_restarted_recursion():
    q, k, v, *_ = gdn_inputs(B=1, T=37)
    leaves = {"q": q.requires_grad_(), "k": k.requires_grad_(), "v": v.requires_grad_()}
    def naive(**x):
        o, (A, k_sum, v_sum, _) = naive_derived_gated_delta(**x, clamp=True)
        return o, A, k_sum, v_sum

    o_ref, (A_ref, k_sum_ref, v_sum_ref) = per_sequence(naive, CU, leaves)
    o, state = derived_gated_delta_rule(q, k, v, output_final_state=True, clamp_ktil=True, cu_seqlens=CU)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state["A"], A_ref.transpose(-1, -2), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state["k_sum"], k_sum_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state["v_sum"], v_sum_ref, rtol=1e-10, atol=1e-10)
    assert state["t"].tolist() == CU.diff().tolist()
    assert_grads_match(leaves, [o], [o_ref])


@pytest.mark.parametrize("normalize", [False, True])
def test_linear_attention_cu_seqlens_matches_restarted_recurrence(normalize):
    q, k, v, _, _ = linear_inputs(Bsz=1, T=37, positive=True)
    leaves = {"q": q.requires_grad_(), "k": k.requires_grad_(), "v": v.requires_grad_()}
    o_ref, (S_ref, z_ref) = per_sequence(naive_linear_attn, CU, leaves, scale=0.7, normalize=normalize)
    o, final = chunk_linear_attn(q, k, v, 0.7, output_final_state=True, normalize=normalize, chunk_size=4,
                                 cu_seqlens=CU)
    S = final[0] if normalize else final
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-10)
    if normalize:
        torch.testing.assert_close(final[1], z_ref, rtol=1e-10, atol=1e-10)
    assert_grads_match(leaves, [o, S], [o_ref, S_ref])


@pytest.mark.parametrize("allow_neg_eigval", [False, True])  # True: a_t < 0 for about half the tokens (test_ssd.py)
def test_ssd_cu_seqlens_matches_restarted_recurrence(allow_neg_eigval):
    inp, _ = ssd_inputs(Bsz=1, T=37)
    per_token = {n: inp.pop(n).requires_grad_() for n in ("x", "dt", "B", "C", "z")}
    y_ref, (S_ref,) = per_sequence(naive_ssd, CU, per_token, **inp, dt_softplus=True, allow_neg_eigval=allow_neg_eigval)
    y, S = mamba_chunk_scan(**per_token, **inp, chunk_size=4, dt_softplus=True, return_final_states=True,
                            cu_seqlens=CU, allow_neg_eigval=allow_neg_eigval)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-10)
    assert_grads_match(per_token, [y, S], [y_ref, S_ref])


def test_cu_seqlens_bad_input_is_one_line():
    q, k, v, g, beta, h0 = gdn_inputs(B=2, T=8)
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3, 16]))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], initial_state=h0[:1],
                               cu_seqlens=torch.tensor([0, 3, 8]))


# ---- the model: a packed row equals its segments run alone ------------------------------------

# Row 0 starts mid-document (position 3) and holds segments of 4, 1, 7 and 4 tokens; row 1 holds 9 + 7.
POSITIONS = torch.tensor([[3, 4, 5, 6, 0, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3],
                          [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6]])
MIXER_OPTIONS = {"gdn": {"chunk_size": 4}, "mamba2": {"chunk_size": 4, "head_dim": 16, "state_size": 8},
                 "linear": {"chunk_size": 4}, "dsa": {"topk": 3, "index_rope_dim": 8, "index_head_dim": 8}}


def tiny_lm(mixer) -> DecoderLM:
    torch.manual_seed(0)
    config = LMConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, mixer=mixer, mixer_options=MIXER_OPTIONS)
    model = DecoderLM(config).double()
    for p in model.parameters():  # past init, so that every part of each mixer matters
        p.data.add_(0.05 * torch.randn_like(p))
    return model


def segment_bounds(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    rows = []
    for row in position_ids.tolist():
        starts = [0] + [t for t in range(1, len(row)) if row[t] == 0]
        rows.append(list(zip(starts, starts[1:] + [len(row)])))
    return rows


@pytest.mark.parametrize("mixer", [*MIXERS.names(), ["gdn", "softmax"]], ids=str)
def test_packed_row_equals_documents_alone(mixer):
    model = tiny_lm(mixer)
    ids = torch.randint(0, 50, POSITIONS.shape, generator=torch.Generator().manual_seed(0))
    packed = model(input_ids=ids, position_ids=POSITIONS).logits
    unmasked = model(input_ids=ids).logits
    for b, bounds in enumerate(segment_bounds(POSITIONS)):
        for start, end in bounds:
            # at its own positions: phi(rotary) of linear attention is not shift-invariant (row 0 starts at 3)
            alone = model(input_ids=ids[b:b + 1, start:end], position_ids=POSITIONS[b:b + 1, start:end]).logits[0]
            torch.testing.assert_close(packed[b, start:end], alone, rtol=1e-9, atol=1e-9)
    # proves the masking ran: without it, the tokens after the first restart see the earlier documents
    assert not torch.allclose(packed[:, 5:], unmasked[:, 5:], atol=1e-4)


@pytest.mark.parametrize("mixer", ["softmax", "gdn", "mamba2", "linear"])
def test_packed_gradients_equal_documents_alone(mixer):
    model = tiny_lm(mixer)
    ids = torch.randint(0, 50, POSITIONS.shape, generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids, position_ids=POSITIONS).loss.backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # the packed loss is the mean over its B T - 1 targets; a segment's target after its last token is
    # the next segment's first token (the EOS that starts it), which the segment alone must predict too
    total = 0
    for b, bounds in enumerate(segment_bounds(POSITIONS)):
        for start, end in bounds:
            logits = model(input_ids=ids[b:b + 1, start:end], position_ids=POSITIONS[b:b + 1, start:end]).logits[0]
            targets = ids[b, start + 1:end + 1]
            total = total + F.cross_entropy(logits[:len(targets)], targets, reduction="sum")
    (total / (ids.numel() - POSITIONS.shape[0])).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed[n], p.grad, rtol=1e-8, atol=1e-10, msg=n)


def test_segments_of_position_ids():
    seg = DocumentSegments(POSITIONS)
    assert seg.cu_seqlens.tolist() == [0, 4, 5, 12, 16, 25, 32]
    b, t, lag = seg.conv_crossings(4)  # the taps of a width-4 conv that reach into an earlier segment
    assert sorted(zip(b.tolist(), t.tolist(), lag.tolist())) == sorted(
        [(0, 4, l) for l in (1, 2, 3)] + [(0, 5, l) for l in (1, 2, 3)] + [(0, 6, l) for l in (2, 3)]
        + [(0, 7, 3)] + [(0, 12, l) for l in (1, 2, 3)] + [(0, 13, l) for l in (2, 3)] + [(0, 14, 3)]
        + [(1, 9, l) for l in (1, 2, 3)] + [(1, 10, l) for l in (2, 3)] + [(1, 11, 3)])


def test_one_document_and_decoding_are_the_plain_forward():
    model = tiny_lm(["softmax", "gdn"])
    ids = torch.randint(0, 50, (1, 8), generator=torch.Generator().manual_seed(0))
    plain = model(input_ids=ids).logits
    torch.testing.assert_close(model(input_ids=ids, position_ids=torch.arange(8)[None]).logits, plain,
                               rtol=1e-12, atol=1e-12)
    # generate passes arange position_ids with a cache; decoding ignores them
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    ref = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert out.tolist() == ref.tolist()


def test_sequence_cumsum_keeps_fp32_precision_late_in_a_long_row():
    x = torch.rand(1, 65536, 4, generator=torch.Generator().manual_seed(0)) + 0.5
    cu = torch.tensor([0, 60000, 60001, 65536])
    ref = torch.cat([x[:, a:b].double().cumsum(1) for a, b in zip(cu.tolist(), cu.tolist()[1:])], 1)
    got = sequence_cumsum(x, cu)
    assert got.dtype == torch.float32
    assert ((got.double() - ref).abs() / ref).max() < 1e-6  # a float32 cumsum minus its prefix: ~1e-3 here
