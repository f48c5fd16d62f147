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
import torch.nn.functional as F

from model.ops import kernels
from model.ops.gated_delta import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from model.ops.linear_attention import chunk_linear_attn
from model.ops.ssd import mamba_chunk_scan

GDN, LINEAR, SSD = "fla.ops.gated_delta_rule", "fla.ops.linear_attn", "fla.ops.simple_gla"
CU_SEQLENS = torch.tensor([0, 13, 83, 100])  # lengths 13, 70, 17: a sequence over two of fla's 64-token chunks
CU_SHORT = torch.tensor([0, 3, 9, 11])  # for the per-token recurrence


def _inputs(seed: int, **shapes) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}


def gdn_inputs(B=2, T=70, H=2, K=16, V=16, state=True) -> dict:
    x = _inputs(0, q=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V), g=(B, T, H), beta=(B, T, H),
                initial_state=(B, H, K, V))
    x["q"], x["k"] = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)  # as GDN's l2norm
    x["g"], x["beta"] = F.logsigmoid(x["g"] + 2), x["beta"].sigmoid()
    x["initial_state"] = 0.1 * x["initial_state"] if state else None
    return x


def linear_inputs(B=2, T=70, H=2, K=16, V=16, state=True) -> dict:
    x = _inputs(1, q=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V), S0=(B, H, K, V), z0=(B, H, K))
    x["q"], x["k"] = F.elu(x["q"]) + 1, F.elu(x["k"]) + 1  # the linear mixer's elu1 feature map
    x["S0"], x["z0"] = (0.1 * x["S0"], F.elu(x["z0"]) + 3) if state else (None, None)
    return x


def ssd_inputs(B=2, T=70, H=4, P=8, G=1, N=16, state=True) -> dict:
    x = _inputs(2, x=(B, T, H, P), dt=(B, T, H), A=(H,), B=(B, T, G, N), C=(B, T, G, N), D=(H,), dt_bias=(H,),
                initial_states=(B, H, P, N))
    x["A"], x["dt_bias"] = -torch.exp(x["A"]), 0.5 * x["dt_bias"] - 2
    x["initial_states"] = 0.1 * x["initial_states"] if state else None
    return x


def gdn_chunk(q, k, v, g, beta, initial_state, cu_seqlens=None):
    o, S = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                  cu_seqlens=cu_seqlens)
    return {"o": o, "state": S}


def gdn_recurrent(q, k, v, g, beta, initial_state, cu_seqlens=None):
    o, S = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                            cu_seqlens=cu_seqlens)
    return {"o": o, "state": S}


def linear(normalize: bool):
    def run(q, k, v, S0, z0, cu_seqlens=None):
        state = None if S0 is None else ((S0, z0) if normalize else S0)
        o, final = chunk_linear_attn(q, k, v, initial_state=state, output_final_state=True, normalize=normalize,
                                     cu_seqlens=cu_seqlens)
        return {"o": o, "state": final[0] if normalize else final}
    return run


def ssd(x, dt, A, B, C, D, dt_bias, initial_states, cu_seqlens=None):
    y, S = mamba_chunk_scan(x, dt, A, B, C, 64, D=D, dt_bias=dt_bias, dt_softplus=True,
                            initial_states=initial_states, return_final_states=True, cu_seqlens=cu_seqlens)
    return {"y": y, "state": S}


def per_sequence(op):
    """The reference for cu_seqlens with initial states, which our PyTorch ops do not take together: op on
    each sequence alone from its own initial state; outputs concatenated, final states stacked."""
    def run(initial_state, cu_seqlens, **x):
        bounds = cu_seqlens.tolist()
        parts = [op(**{n: t[:, a:b] for n, t in x.items()}, initial_state=initial_state[i:i + 1])
                 for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        return {"o": torch.cat([p["o"] for p in parts], 1), "state": torch.cat([p["state"] for p in parts])}
    return run


def varlen(inputs: dict, states: tuple[str, ...]) -> dict:
    """inputs for one packed row of CU_SEQLENS' sequences (B = 1); `states` given one per sequence."""
    return {**inputs, **{n: inputs[n][:1].expand(len(CU_SEQLENS) - 1, *inputs[n].shape[1:]).contiguous()
                         for n in states if inputs[n] is not None}}


T_PACKED = int(CU_SEQLENS[-1])
GDN_GRADS = ("q", "k", "v", "g", "beta", "initial_state")
# name: (our op, its inputs, the inputs differentiated, the fla module and function the dispatch must call,
#        the reference when it is not the same op on the PyTorch path, the dtype fla runs in)
CASES = {
    "gdn chunk, initial state": (gdn_chunk, gdn_inputs(), GDN_GRADS, GDN, "chunk_gated_delta_rule"),
    "gdn chunk, cu_seqlens": (gdn_chunk, {**gdn_inputs(B=1, T=T_PACKED, state=False), "cu_seqlens": CU_SEQLENS},
                              GDN_GRADS[:-1], GDN, "chunk_gated_delta_rule"),
    "gdn chunk, cu_seqlens and initial states": (
        gdn_chunk, varlen({**gdn_inputs(B=1, T=T_PACKED), "cu_seqlens": CU_SEQLENS}, ("initial_state",)),
        GDN_GRADS, GDN, "chunk_gated_delta_rule", per_sequence(gdn_chunk)),
    "gdn chunk, bf16 q k v": (gdn_chunk, gdn_inputs(), GDN_GRADS, GDN, "chunk_gated_delta_rule", None, torch.bfloat16),
    # forward only: fla's fused recurrent GDN has no backward (it raises NotImplementedError); we decode with it
    "gdn recurrent, initial state": (gdn_recurrent, gdn_inputs(T=7), (), GDN, "fused_recurrent_gated_delta_rule"),
    "gdn recurrent, one token": (gdn_recurrent, gdn_inputs(T=1), (), GDN, "fused_recurrent_gated_delta_rule"),
    "gdn recurrent, cu_seqlens": (gdn_recurrent, {**gdn_inputs(B=1, T=11, state=False), "cu_seqlens": CU_SHORT},
                                  (), GDN, "fused_recurrent_gated_delta_rule"),
    "linear, initial state": (linear(False), linear_inputs(), ("q", "k", "v", "S0"), LINEAR, "chunk_linear_attn"),
    "linear normalized, initial state": (linear(True), linear_inputs(), ("q", "k", "v", "S0", "z0"), LINEAR,
                                         "chunk_linear_attn"),
    "linear normalized, cu_seqlens": (linear(True), {**linear_inputs(B=1, T=T_PACKED, state=False),
                                                     "cu_seqlens": CU_SEQLENS}, ("q", "k", "v"), LINEAR,
                                      "chunk_linear_attn"),
    "mamba2 ssd, initial state": (ssd, ssd_inputs(), ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_states"), SSD,
                                  "chunk_simple_gla"),
    "mamba2 ssd, cu_seqlens": (ssd, {**ssd_inputs(B=1, T=T_PACKED, state=False), "cu_seqlens": CU_SEQLENS},
                               ("x", "dt", "A", "B", "C", "D", "dt_bias"), SSD, "chunk_simple_gla"),
}
# the inputs fla gets in the bf16 case's dtype (q, k, v, as GDN hands them); the rest stay fp32
LOW_PRECISION_INPUTS = ("q", "k", "v")


def run(op, inputs: dict, grads: tuple[str, ...], dtype: torch.dtype, low: torch.dtype | None = None) -> dict:
    """op(**inputs) in dtype (`low` for LOW_PRECISION_INPUTS if given): outputs and d(sum_i <out_i, w_i>)/d
    input for `grads`, w_i fixed random; all returned in float64."""
    leaves = {}
    for name, x in inputs.items():
        if torch.is_tensor(x) and x.is_floating_point():
            x = x.to(low if low is not None and name in LOW_PRECISION_INPUTS else dtype, copy=True)
            x.requires_grad_(name in grads)
        leaves[name] = x
    outs = op(**leaves)
    result = {name: out.detach().double() for name, out in outs.items()}
    if grads:
        g = torch.Generator().manual_seed(3)
        loss = sum((out.double() * torch.randn(out.shape, generator=g, dtype=torch.float64)).sum()
                   for _, out in sorted(outs.items()))
        loss.backward()
        result.update({f"d{name}": leaves[name].grad.double() for name in grads})
    return result


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
