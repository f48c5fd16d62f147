"""Worker for tests/test_fla_interpret.py: fla's Triton kernels run on the CPU under Triton's interpreter,
called through our ops' own dispatch, beside our PyTorch path on the same inputs.

    TRITON_INTERPRET=1 python -m tests.fla_interpret_worker OUT.pt [CASE ...]   (from the repo root)

TRITON_INTERPRET is read when a kernel is decorated, i.e. when fla is imported, so it must be set before
that: the test sets it in this process's environment only, and nothing of it reaches other tests. Two
changes to the interpreter make it run what a GPU compiles (no kernel changes):
- each autotuned kernel takes its first config: there is no device to time the configs on;
- the variable of a `for ... in range(...)` loop is a tensor, as in compiled Triton (fla's kernels call
  `i_t.to(tl.int64)` on it; the interpreter hands a Python int).
Each case runs one of our ops twice on the same inputs: once with "cpu" in kernels.KERNEL_DEVICES, so the
dispatch hands the call to fla exactly as on CUDA (the fla function is counted), in the case's dtype; once
on our PyTorch path in float64. OUT gets, per case, both runs' outputs, final states and input gradients
and the call counts; or the error the fla run raised; or, for a case the interpreter cannot run (bf16,
found by a probe), the reason the test skips it.
"""
import ast
import os
import sys
import time
import traceback

import torch

from checks.fla_cases import (gdn_inputs, linear_inputs, op_gdn_chunk, op_gdn_recurrent, op_linear, op_product_chunk,
                              op_product_recurrent, op_ssd, product_inputs, run_op, ssd_inputs)
from model.ops import kernels

GDN, LINEAR, SSD = "fla.ops.gated_delta_rule", "fla.ops.linear_attn", "fla.ops.simple_gla"
DELTA, KDA, GDN2 = "fla.ops.delta_rule", "fla.ops.kda", "fla.ops.gdn2"
CU_SEQLENS = torch.tensor([0, 13, 83, 100])  # lengths 13, 70, 17: a sequence over two of fla's 64-token chunks
CU_SHORT = torch.tensor([0, 3, 9, 11])  # for the per-token recurrence
# small shapes: the interpreter runs every kernel program in Python
GDN_SHAPE, LINEAR_SHAPE, SSD_SHAPE = dict(H=2, K=16, V=16), dict(seed=1, H=2, K=16, V=16), dict(seed=2, H=4, P=8, G=1, N=16)


def per_sequence(op, state: str = "initial_state"):
    """The reference for cu_seqlens with initial states (op's argument `state`), which our PyTorch ops do not
    take together: op on each sequence alone from its own initial state (the per-token inputs, [1, T, ...],
    cut; the rest as given); outputs concatenated in time, final states stacked."""
    def run(cu_seqlens, **x):
        bounds, initial = cu_seqlens.tolist(), x.pop(state)
        parts = [op(**{n: t[:, a:b] if torch.is_tensor(t) and t.dim() > 1 else t for n, t in x.items()},
                    **{state: initial[i:i + 1]})
                 for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        return {k: torch.cat([p[k] for p in parts], 0 if k == "state" else 1) for k in parts[0]}
    return run


def varlen(inputs: dict, states: tuple[str, ...]) -> dict:
    """inputs for one packed row of CU_SEQLENS' sequences (B = 1); `states` given one per sequence."""
    return {**inputs, **{n: inputs[n][:1].expand(len(CU_SEQLENS) - 1, *inputs[n].shape[1:]).contiguous()
                         for n in states if inputs[n] is not None}}


T_PACKED = int(CU_SEQLENS[-1])
GDN_GRADS = ("q", "k", "v", "g", "beta", "initial_state")
SSD_GRADS = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_states")
DELTA_GRADS = ("q", "k", "v", "beta", "initial_state")  # DeltaNet: no decay
GDN2_GRADS = GDN_GRADS + ("write",)  # GDN-2: beta is the erase gate per key channel, write the write gate per value channel
GDN2_INPUTS = dict(decay="per_channel", gates="channel", **GDN_SHAPE)
# name: (our op, its inputs, the inputs differentiated, the fla module and function the dispatch must call,
#        the reference when it is not the same op on the PyTorch path, the dtype fla runs in)
CASES = {
    "gdn chunk, initial state": (op_gdn_chunk, gdn_inputs(70, **GDN_SHAPE), GDN_GRADS, GDN, "chunk_gated_delta_rule"),
    "gdn chunk, cu_seqlens": (op_gdn_chunk, {**gdn_inputs(T_PACKED, B=1, state=False, **GDN_SHAPE), "cu_seqlens": CU_SEQLENS},
                              GDN_GRADS[:-1], GDN, "chunk_gated_delta_rule"),
    "gdn chunk, cu_seqlens and initial states": (
        op_gdn_chunk, varlen({**gdn_inputs(T_PACKED, B=1, **GDN_SHAPE), "cu_seqlens": CU_SEQLENS}, ("initial_state",)),
        GDN_GRADS, GDN, "chunk_gated_delta_rule", per_sequence(op_gdn_chunk)),
    "gdn chunk, bf16 q k v": (op_gdn_chunk, gdn_inputs(70, **GDN_SHAPE), GDN_GRADS, GDN, "chunk_gated_delta_rule", None,
                              torch.bfloat16),
    # forward only: fla's fused recurrent GDN has no backward (it raises NotImplementedError); we decode with it
    "gdn recurrent, initial state": (op_gdn_recurrent, gdn_inputs(7, **GDN_SHAPE), (), GDN, "fused_recurrent_gated_delta_rule"),
    "gdn recurrent, one token": (op_gdn_recurrent, gdn_inputs(1, **GDN_SHAPE), (), GDN, "fused_recurrent_gated_delta_rule"),
    "gdn recurrent, cu_seqlens": (op_gdn_recurrent, {**gdn_inputs(11, B=1, state=False, **GDN_SHAPE), "cu_seqlens": CU_SHORT},
                                  (), GDN, "fused_recurrent_gated_delta_rule"),
    # DeltaNet (no decay) and KDA (a decay per key channel), beta in (0, 2) (allow_neg_eigval)
    # DeltaNet's chunked form runs fla's GDN kernel with g = 0 (fla's chunk_delta_rule refuses float32)
    "deltanet chunk, initial state": (op_gdn_chunk, gdn_inputs(70, decay="none", max_beta=2.0, **GDN_SHAPE), DELTA_GRADS,
                                      GDN, "chunk_gated_delta_rule"),
    "deltanet recurrent, initial state": (op_gdn_recurrent, gdn_inputs(7, decay="none", max_beta=2.0, **GDN_SHAPE), (),
                                          DELTA, "fused_recurrent_delta_rule"),
    "kda chunk, initial state": (op_gdn_chunk, gdn_inputs(40, decay="per_channel", max_beta=2.0, **GDN_SHAPE), GDN_GRADS,
                                 KDA, "chunk_kda"),  # one partial chunk: fla's KDA kernels are slow to interpret
    "kda chunk, cu_seqlens": (op_gdn_chunk, {**gdn_inputs(T_PACKED, B=1, state=False, decay="per_channel", **GDN_SHAPE),
                                             "cu_seqlens": CU_SEQLENS}, GDN_GRADS[:-1], KDA, "chunk_kda"),
    "kda recurrent, initial state": (op_gdn_recurrent, gdn_inputs(7, decay="per_channel", max_beta=2.0, **GDN_SHAPE), (),
                                     KDA, "fused_recurrent_kda"),
    "kda recurrent, one token": (op_gdn_recurrent, gdn_inputs(1, decay="per_channel", **GDN_SHAPE), (), KDA,
                                 "fused_recurrent_kda"),
    # GDN-2 (fla's chunk_gdn2 / fused_recurrent_gdn2): erase gates in (0, 2) (allow_neg_eigval), write gates in (0, 1)
    "gdn2 chunk, initial state": (op_gdn_chunk, gdn_inputs(40, max_beta=2.0, **GDN2_INPUTS), GDN2_GRADS, GDN2,
                                  "chunk_gdn2"),  # one partial chunk
    "gdn2 chunk, cu_seqlens": (op_gdn_chunk, {**gdn_inputs(T_PACKED, B=1, state=False, **GDN2_INPUTS), "cu_seqlens": CU_SEQLENS},
                               GDN_GRADS[:-1] + ("write",), GDN2, "chunk_gdn2"),
    "gdn2 recurrent, initial state": (op_gdn_recurrent, gdn_inputs(7, max_beta=2.0, **GDN2_INPUTS), (), GDN2,
                                      "fused_recurrent_gdn2"),
    "gdn2 recurrent, one token": (op_gdn_recurrent, gdn_inputs(1, **GDN2_INPUTS), (), GDN2, "fused_recurrent_gdn2"),
    # Gated DeltaProduct, 2 Householder steps per token: fla's GDN kernels on the interleaved steps (product.py)
    "deltaproduct chunk, initial state": (op_product_chunk, product_inputs(35, **GDN_SHAPE), GDN_GRADS, GDN,
                                          "chunk_gated_delta_rule"),  # 70 steps: a full chunk and a partial one
    "deltaproduct recurrent, one token": (op_product_recurrent, product_inputs(1, **GDN_SHAPE), (), GDN,
                                          "fused_recurrent_gated_delta_rule"),
    "linear, initial state": (op_linear(False), linear_inputs(70, **LINEAR_SHAPE), ("q", "k", "v", "S0"), LINEAR,
                              "chunk_linear_attn"),
    "linear normalized, initial state": (op_linear(True), linear_inputs(70, **LINEAR_SHAPE), ("q", "k", "v", "S0", "z0"),
                                         LINEAR, "chunk_linear_attn"),
    "linear normalized, cu_seqlens": (op_linear(True), {**linear_inputs(T_PACKED, B=1, state=False, **LINEAR_SHAPE),
                                                        "cu_seqlens": CU_SEQLENS}, ("q", "k", "v"), LINEAR,
                                      "chunk_linear_attn"),
    "mamba2 ssd, initial state": (op_ssd, ssd_inputs(70, **SSD_SHAPE), SSD_GRADS, SSD, "chunk_simple_gla"),
    "mamba2 ssd, cu_seqlens": (op_ssd, {**ssd_inputs(T_PACKED, B=1, state=False, **SSD_SHAPE), "cu_seqlens": CU_SEQLENS},
                               SSD_GRADS[:-1], SSD, "chunk_simple_gla"),
    # allow_neg_eigval: the sign of 2 exp(dt A) - 1 carried around the same kernel; with per-sequence initial
    # states the running sign must restart at each sequence
    "mamba2 ssd negative eigenvalues, initial state": (
        op_ssd, ssd_inputs(70, allow_neg_eigval=True, **SSD_SHAPE), SSD_GRADS, SSD, "chunk_simple_gla"),
    "mamba2 ssd negative eigenvalues, cu_seqlens and initial states": (
        op_ssd, varlen({**ssd_inputs(T_PACKED, B=1, allow_neg_eigval=True, **SSD_SHAPE), "cu_seqlens": CU_SEQLENS},
                       ("initial_states",)),
        SSD_GRADS, SSD, "chunk_simple_gla", per_sequence(op_ssd, "initial_states")),
}


def run(op, inputs: dict, grads: tuple[str, ...], dtype: torch.dtype, low: torch.dtype | None = None) -> dict:
    """run_op on the CPU (its gradients of a loss with fixed random weights), every result in float64."""
    return {name: value.double() for name, value in run_op(op, inputs, "cpu", dtype, grads, seed=3, low=low).items()}


def interpreter_as_compiled() -> None:
    """The two changes to Triton's interpreter described in the module docstring."""
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs
    Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]

    class LoopVariablesAreTensors(interpreter.ASTTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            call = node.iter
            name = getattr(call.func, "id", getattr(call.func, "attr", None)) if isinstance(call, ast.Call) else None
            if name == "range" and isinstance(node.target, ast.Name):
                tensor = ast.Call(func=ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                                                     attr="to_tensor", ctx=ast.Load()),
                                  args=[ast.Name(id=node.target.id, ctx=ast.Load()), ast.Constant(value=False)],
                                  keywords=[])
                node.body.insert(0, ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())], value=tensor))
            return node

    interpreter.FunctionRewriter.ast_transformer = LoopVariablesAreTensors()


def interpreter_bf16_problem() -> str | None:
    """Why Triton's interpreter cannot run bf16 kernels, or None if it computes a bf16 product and dot right."""
    import triton
    import triton.language as tl

    @triton.jit
    def product_and_dot(a, b, prod, dot, N: tl.constexpr):
        i = tl.arange(0, N)
        x, y = tl.load(a + i[:, None] * N + i[None, :]), tl.load(b + i[:, None] * N + i[None, :])
        tl.store(prod + i[:, None] * N + i[None, :], x * y)
        tl.store(dot + i[:, None] * N + i[None, :], tl.dot(x, y))

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=g).bfloat16() for _ in range(2))
    prod, dot = torch.empty(16, 16, dtype=torch.bfloat16), torch.empty(16, 16)
    product_and_dot[(1,)](a, b, prod, dot, 16)
    wrong = [name for name, got, want in (("a * b", prod.float(), (a * b).float()), ("tl.dot(a, b)", dot, a.float() @ b.float()))
             if not torch.allclose(got, want, rtol=1e-2, atol=1e-2)]
    if wrong:
        return (f"Triton {triton.__version__}'s interpreter computes {' and '.join(wrong)} of bf16 values wrong "
                "(it keeps bf16 as raw uint16 bits and runs numpy arithmetic and matmul on the bits)")
    return None


def run_case(spec) -> dict:
    import importlib

    op, inputs, grads, module, attr, reference, low = (*spec, None, None)[:7]
    if low == torch.bfloat16 and (problem := interpreter_bf16_problem()):
        return {"skip": problem, "fla_calls": 0}
    fla_module = importlib.import_module(module)
    original, calls = getattr(fla_module, attr), []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(fla_module, attr, counted)
    try:
        t0 = time.perf_counter()
        kernels.KERNEL_DEVICES = ("cpu",)
        try:
            fla = run(op, inputs, grads, torch.float32, low)
        except Exception as e:  # the test fails with it
            frame = traceback.extract_tb(e.__traceback__)[-1]
            return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                             f"(at {os.path.relpath(frame.filename)}:{frame.lineno})", "fla_calls": len(calls)}
        fla_calls, seconds = len(calls), time.perf_counter() - t0
        kernels.KERNEL_DEVICES = ("cuda",)
        ours = run(reference or op, inputs, grads, torch.float64)
        return {"fla": fla, "ours": ours, "fla_calls": fla_calls, "ours_calls": len(calls) - fla_calls,
                "seconds": seconds}
    finally:
        setattr(fla_module, attr, original)
        kernels.KERNEL_DEVICES = ("cuda",)


def main(out: str, names: list[str]) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" or "fla" in sys.modules:
        raise SystemExit("TRITON_INTERPRET=1 must be set before fla is imported")
    torch.set_num_threads(1)
    interpreter_as_compiled()
    torch.save({name: run_case(CASES[name]) for name in names or CASES}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
