"""model.ops.ssd against the SSD recurrence written out token by token (float64)."""
import pytest
import torch

from model.ops.ssd import mamba_chunk_scan, mamba_state_step, naive_ssd


def make_inputs(Bsz=2, T=19, H=4, P=3, G=2, N=5, D_shape="h", with_z=True, with_h0=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    inp = dict(
        x=r(Bsz, T, H, P),
        dt=r(Bsz, T, H) * 0.5,
        A=-torch.rand(H, generator=g, dtype=torch.float64) * 2 - 0.1,
        B=r(Bsz, T, G, N),
        C=r(Bsz, T, G, N),
        D={"h": r(H), "hp": r(H, P), None: None}[D_shape],
        z=r(Bsz, T, H, P) if with_z else None,
        dt_bias=r(H) * 0.5,
    )
    h0 = r(Bsz, H, P, N) if with_h0 else None
    return inp, h0


@pytest.mark.parametrize("chunk", [4, 8, 64])
@pytest.mark.parametrize("G,with_h0,D_shape,with_z", [(2, True, "h", True), (1, False, None, False), (4, True, "hp", False)])
def test_chunk_scan_matches_recurrence(chunk, G, with_h0, D_shape, with_z):
    inp, h0 = make_inputs(G=G, with_h0=with_h0, D_shape=D_shape, with_z=with_z)
    y, final = mamba_chunk_scan(**inp, chunk_size=chunk, dt_softplus=True, initial_states=h0, return_final_states=True)
    y_ref, final_ref = naive_ssd(**inp, dt_softplus=True, h0=h0)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)


def test_without_softplus_or_bias():
    inp, _ = make_inputs(with_h0=False)
    inp["dt"] = inp["dt"].abs()
    inp["dt_bias"] = None
    y = mamba_chunk_scan(**inp, chunk_size=8)
    torch.testing.assert_close(y, naive_ssd(**inp)[0], rtol=1e-10, atol=1e-10)


def test_gradients_match_recurrence():
    inp, h0 = make_inputs(T=11, G=2)
    leaves = {k: v.clone().requires_grad_() for k, v in inp.items()}
    h0 = h0.clone().requires_grad_()
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(inp["x"].shape, generator=g)
    dh = torch.randn(h0.shape, generator=g)

    def grads(fn):
        y, final = fn()
        return torch.autograd.grad((y * dy).sum() + (final * dh).sum(), [*leaves.values(), h0])

    ours = grads(lambda: mamba_chunk_scan(**leaves, chunk_size=4, dt_softplus=True, initial_states=h0,
                                          return_final_states=True))
    ref = grads(lambda: naive_ssd(**leaves, dt_softplus=True, h0=h0))
    for name, a, b in zip([*leaves, "initial_states"], ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"grad of {name}: {m}")


def test_split_sequence_carries_state():
    inp, h0 = make_inputs(T=23)
    y_full, final_full = mamba_chunk_scan(**inp, chunk_size=8, dt_softplus=True, initial_states=h0,
                                          return_final_states=True)
    cut = 10
    first = {k: (v[:, :cut] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
    second = {k: (v[:, cut:] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
    y1, s1 = mamba_chunk_scan(**first, chunk_size=8, dt_softplus=True, initial_states=h0, return_final_states=True)
    y2, s2 = mamba_chunk_scan(**second, chunk_size=8, dt_softplus=True, initial_states=s1, return_final_states=True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y_full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2, final_full, rtol=1e-10, atol=1e-10)


def test_state_step_matches_recurrence():
    inp, h0 = make_inputs(T=6)
    y_ref, final_ref = naive_ssd(**inp, dt_softplus=True, h0=h0)
    state, ys = h0, []
    for t in range(6):
        step = {k: (v[:, t] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
        y, state = mamba_state_step(**step, state=state, dt_softplus=True)
        ys.append(y)
    torch.testing.assert_close(torch.stack(ys, 1), y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, final_ref, rtol=1e-10, atol=1e-10)


def test_long_sequence_strong_decay_is_finite():
    """Many chunks with large dt: the chunk-level decays underflow to 0 without NaN/inf (fp32)."""
    inp, h0 = make_inputs(T=300, G=1, with_h0=True)
    inp = {k: (v.float() if v is not None else v) for k, v in inp.items()}
    inp["dt"] = inp["dt"] + 4.0
    inp["A"] = inp["A"] * 8
    x = inp["x"].requires_grad_()
    y, final = mamba_chunk_scan(**inp, chunk_size=16, dt_softplus=True, initial_states=h0.float(),
                                return_final_states=True)
    (y.sum() + final.sum()).backward()
    assert torch.isfinite(y).all() and torch.isfinite(final).all() and torch.isfinite(x.grad).all()
    y_ref, _ = naive_ssd(**{k: (v.detach().double() if v is not None else v) for k, v in inp.items()},
                         dt_softplus=True, h0=h0)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)
