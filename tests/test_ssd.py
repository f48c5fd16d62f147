"""model.ops.ssd against the SSD recurrence written out token by token (float64), with the transition
exp(dt A) and with allow_neg_eigval's 2 exp(dt A) - 1 (make_inputs gives a_t < 0 for about half the
tokens then: test_inputs_give_negative_transitions)."""
import math

import pytest
import torch
import torch.nn.functional as F

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


def signed_transitions(inp: dict) -> torch.Tensor:
    """a_t = 2 exp(dt_t A) - 1 for make_inputs' dt (softplus'd with its bias) and A, written out here."""
    return 2 * torch.exp(F.softplus(inp["dt"] + inp["dt_bias"]) * inp["A"]) - 1


def test_inputs_give_negative_transitions():
    """The allow_neg_eigval cases below see both signs (else they could not tell the option from its absence)."""
    for Bsz, T in ((2, 19), (2, 11), (2, 23), (1, 37)):
        negative = (signed_transitions(make_inputs(Bsz=Bsz, T=T)[0]) < 0).double().mean().item()
        assert 0.2 < negative < 0.8, (Bsz, T, negative)


def test_negative_transition_flips_the_state():
    """One token with x = 0 from h0: the state is a h0 with a = 2 exp(dt A) - 1 < 0 (and exp(dt A) without the option)."""
    inp, h0 = make_inputs(Bsz=1, T=1, H=1, G=1, D_shape=None, with_z=False)
    inp.update(x=torch.zeros_like(inp["x"]), dt=torch.full_like(inp["dt"], 2.0), A=torch.tensor([-1.0], dtype=torch.float64),
               dt_bias=None)
    for allow, a in ((True, 2 * math.exp(-2.0) - 1), (False, math.exp(-2.0))):
        for run in (lambda: mamba_chunk_scan(**inp, chunk_size=4, initial_states=h0, return_final_states=True,
                                             allow_neg_eigval=allow)[1],
                    lambda: mamba_state_step(**{k: (v[:, 0] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()},
                                             state=h0, allow_neg_eigval=allow)[1],
                    lambda: naive_ssd(**inp, h0=h0, allow_neg_eigval=allow)[1]):
            torch.testing.assert_close(run(), a * h0, rtol=1e-12, atol=0)


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
@pytest.mark.parametrize("chunk", [4, 8, 64])
@pytest.mark.parametrize("G,with_h0,D_shape,with_z", [(2, True, "h", True), (1, False, None, False), (4, True, "hp", False)])
def test_chunk_scan_matches_recurrence(chunk, G, with_h0, D_shape, with_z, allow_neg_eigval):
    inp, h0 = make_inputs(G=G, with_h0=with_h0, D_shape=D_shape, with_z=with_z)
    y, final = mamba_chunk_scan(**inp, chunk_size=chunk, dt_softplus=True, initial_states=h0, return_final_states=True,
                                allow_neg_eigval=allow_neg_eigval)
    y_ref, final_ref = naive_ssd(**inp, dt_softplus=True, h0=h0, allow_neg_eigval=allow_neg_eigval)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)


def test_without_softplus_or_bias():
    inp, _ = make_inputs(with_h0=False)
    inp["dt"] = inp["dt"].abs()
    inp["dt_bias"] = None
    y = mamba_chunk_scan(**inp, chunk_size=8)
    torch.testing.assert_close(y, naive_ssd(**inp)[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_gradients_match_recurrence(allow_neg_eigval):
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
                                          return_final_states=True, allow_neg_eigval=allow_neg_eigval))
    ref = grads(lambda: naive_ssd(**leaves, dt_softplus=True, h0=h0, allow_neg_eigval=allow_neg_eigval))
    for name, a, b in zip([*leaves, "initial_states"], ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_split_sequence_carries_state(allow_neg_eigval):
    inp, h0 = make_inputs(T=23)
    kw = dict(chunk_size=8, dt_softplus=True, return_final_states=True, allow_neg_eigval=allow_neg_eigval)
    y_full, final_full = mamba_chunk_scan(**inp, initial_states=h0, **kw)
    cut = 10
    first = {k: (v[:, :cut] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
    second = {k: (v[:, cut:] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
    y1, s1 = mamba_chunk_scan(**first, initial_states=h0, **kw)
    y2, s2 = mamba_chunk_scan(**second, initial_states=s1, **kw)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y_full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2, final_full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_state_step_matches_recurrence(allow_neg_eigval):
    inp, h0 = make_inputs(T=6)
    y_ref, final_ref = naive_ssd(**inp, dt_softplus=True, h0=h0, allow_neg_eigval=allow_neg_eigval)
    state, ys = h0, []
    for t in range(6):
        step = {k: (v[:, t] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
        y, state = mamba_state_step(**step, state=state, dt_softplus=True, allow_neg_eigval=allow_neg_eigval)
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


def at_transitions(inp: dict, a: torch.Tensor) -> dict:
    """inp with dt (no softplus, no bias) set so that 2 exp(dt A) - 1 = a, a [B, T, H] in (-1, 1)."""
    return {**inp, "dt": torch.log((a + 1) / 2) / inp["A"], "dt_bias": None}


def test_negative_transitions_near_zero_and_minus_one():
    """|a_t| down to 1e-7 (above the float64 floor, sqrt(eps) = 1.5e-8) and a_t up to 1e-12 from -1: outputs, final
    states and gradients (through a_t's 1 / a in log space) as the recurrence."""
    inp, h0 = make_inputs(T=21, G=1)
    values = torch.tensor([1e-3, -1e-3, 1e-5, -1e-5, 1e-7, -1e-7, -1 + 1e-6, -1 + 1e-9, -1 + 1e-12, 0.5], dtype=torch.float64)
    pick = torch.randint(0, len(values), inp["dt"].shape, generator=torch.Generator().manual_seed(4))
    inp = at_transitions(inp, values[pick])
    leaves = {k: v.clone().requires_grad_() for k, v in inp.items() if v is not None and k != "A"}
    w = torch.randn(inp["x"].shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def run(fn):
        y, final = fn({**inp, **leaves})
        return [y, final, *torch.autograd.grad((y * w).sum() + final.sum(), list(leaves.values()))]

    ours = run(lambda x: mamba_chunk_scan(**x, chunk_size=8, initial_states=h0, return_final_states=True,
                                          allow_neg_eigval=True))
    ref = run(lambda x: naive_ssd(**x, h0=h0, allow_neg_eigval=True))
    for name, a, b in zip(["y", "final", *(f"d{k}" for k in leaves)], ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7 * b.abs().max().item(), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_transition_at_zero_is_floored(dtype):
    """a_t = 0 exactly (log|a| = -inf) and |a_t| < sqrt(eps): finite outputs and gradients, chunked and stepped
    alike, and the recurrence's values up to the floor (|a| -> sqrt(eps) moves h by at most sqrt(eps) |h|)."""
    inp, h0 = make_inputs(T=13, H=2, G=1, with_z=False)
    inp["A"] = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    a = torch.tensor([0.0, 1e-12, -1e-12, 0.5, -0.5], dtype=torch.float64)
    inp = at_transitions(inp, a[torch.randint(0, len(a), inp["dt"].shape, generator=torch.Generator().manual_seed(6))])
    inp = {k: (v.to(dtype) if v is not None else None) for k, v in inp.items()}
    assert ((2 * torch.exp(inp["dt"] * inp["A"]) - 1) == 0).any()  # in `dtype`: log|a| = -inf without the floor
    leaves = {k: inp[k].clone().requires_grad_() for k in ("x", "dt", "B", "C", "D")}
    y, final = mamba_chunk_scan(**{**inp, **leaves}, chunk_size=4, initial_states=h0.to(dtype), return_final_states=True,
                                allow_neg_eigval=True)
    grads = torch.autograd.grad(y.sum() + final.sum(), list(leaves.values()))
    assert all(torch.isfinite(t).all() for t in (y, final, *grads))
    state, steps = h0.to(dtype), []
    for t in range(13):
        out, state = mamba_state_step(**{k: (v[:, t] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()},
                                      state=state, allow_neg_eigval=True)
        steps.append(out)
    torch.testing.assert_close(torch.stack(steps, 1), y, rtol=1e-5, atol=1e-5)
    y_ref, final_ref = naive_ssd(**{k: (v.double() if v is not None else None) for k, v in inp.items()}, h0=h0,
                                 allow_neg_eigval=True)
    floor = torch.finfo(dtype).eps ** 0.5
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=10 * floor * y_ref.abs().max().item())
    torch.testing.assert_close(final.double(), final_ref, rtol=0, atol=10 * floor * final_ref.abs().max().item())
