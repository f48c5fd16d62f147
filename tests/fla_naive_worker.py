"""Worker for tests/test_fla_naive.py: fla's own PyTorch references (its naive.py: float32, token by token or by
chunks) beside our ops on the same inputs, GDN-2 and Gated DeltaProduct.

    python -m tests.fla_naive_worker OUT.pt   (from the repo root)

Each case runs one of fla's references in float32 and one of ours in float64 (run_op: outputs, final state and the
gradients of a fixed random loss), both from the same float32 inputs. OUT gets, per case, both runs' results in
float64, or the error either raised. It imports fla (which registers its models with transformers and imports
Triton), hence a subprocess; our ops take their PyTorch path (CPU tensors, KERNEL_DEVICES untouched).
"""
import sys
import traceback

import torch

from checks.fla_cases import gdn_inputs, product_inputs, run_op
from model.ops.gated_delta import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, naive_gated_delta
from model.ops.gated_delta.naive import naive_gated_delta_product
from model.ops.gated_delta.product import chunk_gated_delta_product, fused_recurrent_gated_delta_product

SHAPE = dict(B=2, H=2, K=16, V=8)
# GDN-2: a decay and an erase gate (in (0, 2): allow_neg_eigval) per key channel, a write gate per value channel;
# T = 75: a full chunk of fla's 64 and a partial one, two of ours (32) and a partial one
GDN2 = gdn_inputs(75, seed=4, decay="per_channel", gates="channel", max_beta=2.0, **SHAPE)
PRODUCT = {n: product_inputs(37, steps=n, seed=5, **SHAPE) for n in (2, 3)}  # 74 and 111 steps, beta in (0, 2)
CU_SEQLENS = torch.tensor([0, 5, 6, 37])  # tokens: 5, 1 and 31 per sequence (x n steps)
PACKED = product_inputs(37, steps=2, seed=6, B=1, H=2, K=16, V=8, state=False)
GDN2_GRADS = ("q", "k", "v", "g", "beta", "write", "initial_state")
PRODUCT_GRADS = ("q", "k", "v", "g", "beta", "initial_state")


def fla_gdn2(form: str):
    def run(q, k, v, g, beta, write, initial_state):
        from fla.ops.gdn2 import naive_chunk_gdn2, naive_recurrent_gdn2

        naive = naive_chunk_gdn2 if form == "chunk" else naive_recurrent_gdn2
        o, S = naive(q, k, v, g, beta, write, initial_state=initial_state, output_final_state=True)
        return {"o": o, "state": S}
    return run


def ours_gdn2(form: str):
    def run(q, k, v, g, beta, write, initial_state):
        if form == "naive":
            o, S = naive_gated_delta(q, k, v, g, beta, h=initial_state, write=write)
        else:
            op = chunk_gated_delta_rule if form == "chunk" else fused_recurrent_gated_delta_rule
            o, S = op(q, k, v, g, beta, initial_state=initial_state, output_final_state=True, write=write)
        return {"o": o, "state": S}
    return run


def fla_product(q, k, v, g, beta, initial_state=None, cu_seqlens=None):
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product

    o, S = naive_recurrent_gated_delta_product(q, k, v, g, beta, q.shape[-1] ** -0.5, cu_seqlens=cu_seqlens,
                                               initial_state=initial_state, output_final_state=True,
                                               num_householder=k.shape[1] // q.shape[1])
    return {"o": o, "state": S}


def ours_product(form: str):
    def run(q, k, v, g, beta, initial_state=None, cu_seqlens=None):
        n = k.shape[1] // q.shape[1]
        if form == "naive":
            o, S = naive_gated_delta_product(q, k, v, g, beta, n, h=initial_state)
        else:
            op = chunk_gated_delta_product if form == "chunk" else fused_recurrent_gated_delta_product
            o, S = op(q, k, v, g, beta, n, initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens)
        return {"o": o, "state": S}
    return run


# name: (fla's reference, ours, the inputs, the inputs differentiated)
CASES = {
    **{f"gdn2: fla naive_{theirs}_gdn2 vs our {ours}": (fla_gdn2(theirs), ours_gdn2(ours), GDN2, GDN2_GRADS)
       for theirs in ("recurrent", "chunk") for ours in ("naive", "chunk", "recurrent")},
    **{f"deltaproduct n={n}: fla naive_recurrent_gated_delta_product vs our {ours}": (
        fla_product, ours_product(ours), PRODUCT[n], PRODUCT_GRADS) for n in (2, 3) for ours in ("naive", "chunk", "recurrent")},
    **{f"deltaproduct n=2 cu_seqlens: fla naive_recurrent_gated_delta_product vs our {ours}": (
        fla_product, ours_product(ours), {**PACKED, "cu_seqlens": CU_SEQLENS}, PRODUCT_GRADS[:-1]) for ours in ("chunk", "recurrent")},
}


def run_case(theirs, ours, inputs, grads) -> dict:
    try:
        fla = run_op(theirs, inputs, "cpu", torch.float32, grads, seed=7)
        mine = run_op(ours, inputs, "cpu", torch.float64, grads, seed=7)
    except Exception as e:  # the test fails with it
        frame = traceback.extract_tb(e.__traceback__)[-1]
        return {"error": f"{type(e).__name__}: {e} (at {frame.filename}:{frame.lineno})"}
    return {"fla": {k: v.double() for k, v in fla.items()}, "ours": {k: v.double() for k, v in mine.items()}}


def main(out: str) -> None:
    torch.set_num_threads(1)
    torch.save({name: run_case(*spec) for name, spec in CASES.items()}, out)


if __name__ == "__main__":
    main(sys.argv[1])
