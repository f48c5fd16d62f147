"""fla's op inputs and runs, shared by the GPU self-check (checks/kernels.py: every fla kernel on CUDA against our
CPU path) and tests/fla_interpret_worker.py (the same kernels under Triton's interpreter on the CPU): inputs shaped
as the mixers hand them, each op called through our dispatch, outputs and input gradients of a fixed random loss."""
import torch
import torch.nn.functional as F

from checks.stage import BF16_FWD_TOL, BF16_GRAD_TOL, FWD_TOL, GRAD_TOL, mismatch

CU_SEQLENS = [0, 100, 101, 350, 600]  # documents of 100, 1, 249 and 250 tokens: none a multiple of a chunk
LOW_PRECISION = ("q", "k", "v", "x", "dt", "B", "C")  # what the mixers hand the ops in bf16 under autocast


def _randn(seed: int, **shapes) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}


def gdn_inputs(T: int, seed: int = 0, B=2, H=4, K=64, V=128, state=True, decay="per_head", max_beta=1.0,
               gates="scalar") -> dict:
    """The delta rule's inputs; decay: "per_head" (GDN: g [B, T, H]), "per_channel" (KDA: g [B, T, H, K]) or
    "none" (DeltaNet: no g); max_beta=2: beta in (0, 2), as allow_neg_eigval gives. gates="channel": GDN-2's, beta
    an erase gate per key channel [B, T, H, K] in (0, max_beta) and write a write gate per value channel
    [B, T, H, V] in (0, 1) (drawn after the rest: the other inputs are those of gates="scalar")."""
    shapes = dict(q=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V), g=(B, T, H, K), beta=(B, T, H), initial_state=(B, H, K, V))
    x = _randn(seed, **shapes, **(dict(erase=(B, T, H, K), write=(B, T, H, V)) if gates == "channel" else {}))
    x["q"], x["k"] = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)
    x["g"], x["beta"] = F.logsigmoid(x["g"] + 3), max_beta * x["beta"].sigmoid()
    x["initial_state"] = 0.1 * x["initial_state"] if state else None
    if gates == "channel":
        x["beta"], x["write"] = max_beta * x.pop("erase").sigmoid(), x["write"].sigmoid()
    if decay == "per_head":
        x["g"] = x["g"][..., 0].contiguous()
    elif decay == "none":
        del x["g"]
    return x


def product_inputs(T: int, steps: int = 2, seed: int = 0, B=2, H=4, K=64, V=128, state=True, max_beta=2.0) -> dict:
    """Gated DeltaProduct's inputs (model/ops/gated_delta/product.py): q [B, T, H, K], g [B, T, H] per token; k, v,
    beta [B, T steps, H, *] per Householder step, a token's steps consecutive; beta in (0, max_beta)."""
    n = T * steps
    x = _randn(seed, q=(B, T, H, K), k=(B, n, H, K), v=(B, n, H, V), g=(B, T, H), beta=(B, n, H), initial_state=(B, H, K, V))
    x["q"], x["k"] = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)
    x["g"], x["beta"] = F.logsigmoid(x["g"] + 3), max_beta * x["beta"].sigmoid()
    x["initial_state"] = 0.1 * x["initial_state"] if state else None
    return x


def linear_inputs(T: int, seed: int = 0, B=2, H=4, K=64, V=64, state=True) -> dict:
    x = _randn(seed, q=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V), S0=(B, H, K, V), z0=(B, 8, H, K))
    x["q"], x["k"] = F.elu(x["q"]) + 1, F.elu(x["k"]) + 1
    x["S0"], x["z0"] = (0.1 * x["S0"], (F.elu(x["z0"]) + 1).sum(1)) if state else (None, None)
    return x


def ssd_inputs(T: int, seed: int = 0, B=2, H=4, P=64, G=2, N=64, state=True, allow_neg_eigval=False) -> dict:
    """allow_neg_eigval: the transition 2 exp(dt A) - 1, with dt large enough (dt_bias around 0) that it takes
    both signs (negative where dt |A| > log 2)."""
    x = _randn(seed, x=(B, T, H, P), dt=(B, T, H), A=(H,), B=(B, T, G, N), C=(B, T, G, N), D=(H,), dt_bias=(H,),
               initial_states=(B, H, P, N))
    x["A"], x["dt_bias"] = -torch.exp(x["A"]), 0.5 * x["dt_bias"] - (0 if allow_neg_eigval else 3)
    x["initial_states"] = 0.1 * x["initial_states"] if state else None
    if allow_neg_eigval:
        x["allow_neg_eigval"] = True
    return x


def packed(inputs: dict) -> dict:
    """The inputs (made with B=1, T=CU_SEQLENS[-1], no state) with the documents' cu_seqlens."""
    return {**inputs, "cu_seqlens": torch.tensor(CU_SEQLENS)}


def run_op(fn, inputs: dict, device, dtype, grads: tuple[str, ...] = (), seed: int = 1,
           low: torch.dtype | None = None) -> dict:
    """fn(**inputs) on `device` in `dtype` (LOW_PRECISION inputs in `low` if given); with `grads`, also
    d<name> for those inputs of sum_i <out_i, w_i> with fixed random w_i. Everything returned is on the CPU."""
    leaves = {}
    for name, x in inputs.items():
        if torch.is_tensor(x) and x.is_floating_point():
            x = x.to(device=device, dtype=low if low is not None and name in LOW_PRECISION else dtype, copy=True)
            x.requires_grad_(name in grads)
        elif torch.is_tensor(x):
            x = x.to(device)
        leaves[name] = x
    outs = fn(**leaves)
    result = {k: v.detach().cpu() for k, v in outs.items()}
    if grads:
        g = torch.Generator().manual_seed(seed)
        loss = sum((v.double() * torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.device)).sum()
                   for _, v in sorted(outs.items()))
        loss.backward()
        result.update({f"d{k}": leaves[k].grad.cpu() for k in grads})
    return result


def rounded(inputs: dict, low: torch.dtype) -> dict:
    """The inputs with the LOW_PRECISION ones rounded to `low`: the reference then sees what the kernel sees."""
    return {k: v.to(low).float() if torch.is_tensor(v) and k in LOW_PRECISION else v for k, v in inputs.items()}


def compare_runs(name: str, got: dict, want: dict, bf16: bool = False) -> list[str]:
    fwd, grad = (BF16_FWD_TOL, BF16_GRAD_TOL) if bf16 else (FWD_TOL, GRAD_TOL)
    return [line for key in want if (line := mismatch(f"{name} {key}", got[key], want[key], grad if key.startswith("d") else fwd))]


def op_gdn_chunk(q, k, v, beta, g=None, initial_state=None, cu_seqlens=None, write=None):
    from model.ops.gated_delta import chunk_gated_delta_rule

    o, S = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                  cu_seqlens=cu_seqlens, write=write)
    return {"o": o, "state": S}


def op_gdn_recurrent(q, k, v, beta, g=None, initial_state=None, cu_seqlens=None, write=None):
    from model.ops.gated_delta import fused_recurrent_gated_delta_rule

    o, S = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                            cu_seqlens=cu_seqlens, write=write)
    return {"o": o, "state": S}


def op_product_chunk(q, k, v, beta, g=None, initial_state=None, cu_seqlens=None):
    """Gated DeltaProduct, k.shape[1] // q.shape[1] steps per token (product_inputs)."""
    from model.ops.gated_delta.product import chunk_gated_delta_product

    o, S = chunk_gated_delta_product(q, k, v, g, beta, k.shape[1] // q.shape[1], initial_state=initial_state,
                                     output_final_state=True, cu_seqlens=cu_seqlens)
    return {"o": o, "state": S}


def op_product_recurrent(q, k, v, beta, g=None, initial_state=None, cu_seqlens=None):
    from model.ops.gated_delta.product import fused_recurrent_gated_delta_product

    o, S = fused_recurrent_gated_delta_product(q, k, v, g, beta, k.shape[1] // q.shape[1], initial_state=initial_state,
                                               output_final_state=True, cu_seqlens=cu_seqlens)
    return {"o": o, "state": S}


def op_linear(normalize: bool):
    def run(q, k, v, S0=None, z0=None, cu_seqlens=None):
        from model.ops.linear_attention import chunk_linear_attn

        state = None if S0 is None else ((S0, z0) if normalize else S0)
        o, final = chunk_linear_attn(q, k, v, initial_state=state, output_final_state=True, normalize=normalize,
                                     cu_seqlens=cu_seqlens)
        return {"o": o, "state": final[0] if normalize else final}
    return run


def op_ssd(x, dt, A, B, C, D, dt_bias, initial_states=None, cu_seqlens=None, allow_neg_eigval=False):
    from model.ops.ssd import mamba_chunk_scan

    y, S = mamba_chunk_scan(x, dt, A, B, C, 64, D=D, dt_bias=dt_bias, dt_softplus=True,
                            initial_states=initial_states, return_final_states=True, cu_seqlens=cu_seqlens,
                            allow_neg_eigval=allow_neg_eigval)
    return {"y": y, "state": S}
