"""model.ops.linear_attention against the recurrence written out token by token (float64)."""
import pytest
import torch

from conftest import assert_bf16_rounding_of
from model.ops.linear_attention import chunk_linear_attn, naive_linear_attn

EPS = 1e-6


def make_inputs(Bsz=2, T=21, H=3, K=4, V=5, positive=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = r(Bsz, T, H, K), r(Bsz, T, H, K), r(Bsz, T, H, V)
    S0, z0 = r(Bsz, H, K, V), r(Bsz, H, K)
    if positive:  # the normaliser needs positive features (as elu + 1 gives)
        q, k, z0 = q.exp(), k.exp(), z0.exp()
    return q, k, v, S0, z0


@pytest.mark.parametrize("chunk", [4, 8, 64])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_recurrence(chunk, normalize, with_state):
    q, k, v, S0, z0 = make_inputs(positive=normalize)
    if not with_state:
        S0 = z0 = None
    init = (S0, z0) if normalize else S0
    o, final = chunk_linear_attn(q, k, v, scale=0.7, initial_state=init if with_state else None,
                                 output_final_state=True, normalize=normalize, chunk_size=chunk, eps=EPS)
    o_ref, S_ref, z_ref = naive_linear_attn(q, k, v, 0.7, S0, z0, normalize, EPS)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    if normalize:
        torch.testing.assert_close(final[0], S_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(final[1], z_ref, rtol=1e-10, atol=1e-10)
    else:
        torch.testing.assert_close(final, S_ref, rtol=1e-10, atol=1e-10)


def test_default_scale_is_inverse_sqrt_k():
    q, k, v, _, _ = make_inputs()
    o, _ = chunk_linear_attn(q, k, v, chunk_size=8)
    torch.testing.assert_close(o, naive_linear_attn(q, k, v, 4**-0.5)[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("normalize", [False, True])
def test_gradients_match_recurrence(normalize):
    q, k, v, S0, z0 = (t.requires_grad_() for t in make_inputs(T=10, positive=normalize))
    g = torch.Generator().manual_seed(1)
    do = torch.randn(v.shape, generator=g, dtype=torch.float64)
    dS = torch.randn(S0.shape, generator=g, dtype=torch.float64)
    leaves = [q, k, v, S0] + ([z0] if normalize else [])

    def grads(o, S):
        return torch.autograd.grad((o * do).sum() + (S * dS).sum(), leaves)

    o, final = chunk_linear_attn(q, k, v, scale=0.5, initial_state=(S0, z0) if normalize else S0,
                                 output_final_state=True, normalize=normalize, chunk_size=4, eps=EPS)
    ours = grads(o, final[0] if normalize else final)
    o_ref, S_ref, _ = naive_linear_attn(q, k, v, 0.5, S0, z0 if normalize else None, normalize, EPS)
    ref = grads(o_ref, S_ref)
    for name, a, b in zip(["q", "k", "v", "S0", "z0"], ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("normalize", [False, True])
def test_split_sequence_carries_state(normalize):
    q, k, v, _, _ = make_inputs(T=19, positive=normalize)
    o_full, final_full = chunk_linear_attn(q, k, v, output_final_state=True, normalize=normalize, chunk_size=8)
    o1, s1 = chunk_linear_attn(q[:, :7], k[:, :7], v[:, :7], output_final_state=True, normalize=normalize, chunk_size=8)
    parts, state = [o1], s1
    for t in range(7, 19):  # then token by token (chunk of 1), as in decoding
        o, state = chunk_linear_attn(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], initial_state=state,
                                     output_final_state=True, normalize=normalize, chunk_size=8)
        parts.append(o)
    torch.testing.assert_close(torch.cat(parts, 1), o_full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, final_full, rtol=1e-10, atol=1e-10)


def test_half_inputs_accumulate_in_fp32():
    """bf16 inputs over 256 tokens (state and normaliser sums of 256 terms): the output is the float64
    recurrence of the same bf16 values rounded once to bf16, which the recurrence run in bf16 is not."""
    q, k, v = (x.bfloat16() for x in make_inputs(Bsz=1, T=256, positive=True)[:3])
    o_ref, _, _ = naive_linear_attn(q.double(), k.double(), v.double(), 4**-0.5, normalize=True)
    o, _ = chunk_linear_attn(q, k, v, normalize=True, chunk_size=16)
    assert o.dtype == torch.bfloat16
    assert_bf16_rounding_of(o, o_ref)
    bf16, _, _ = naive_linear_attn(q, k, v, 4**-0.5, normalize=True)
    with pytest.raises(AssertionError):  # accumulating in bf16 fails at this size
        assert_bf16_rounding_of(bf16, o_ref)
