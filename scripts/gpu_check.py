"""GPU self-check in two stages, each within its own time budget on one H100/H200, fla's autotuning
included (docs/gpu.md: how to run them, what each check proves).

    python scripts/gpu_check.py --stage kernels   # budget 4 min: the fast paths training uses, against our CPU path
    python scripts/gpu_check.py --stage train     # budget 5 min: model=125m per mixer at T=2048 through train.py

A stage prints its budget, then runs its checks one by one. Every case of a check is guarded (an
exception is that case's failure) and every check runs under its own deadline (SIGALRM; the deadlines
add up to the budget, so the stage ends within it by construction): one failure or overrun cannot hide
the other checks or the summary. The stage ends with a summary table, writes every result to a JSON
file (its path is printed) and exits 1 on any mismatch. Without CUDA a stage runs its CPU part and
lists the checks that need CUDA.

Stage kernels (CUDA unless marked CPU):
  cpu      (CPU) our PyTorch paths agree with each other in float64; the MFU peak tables
  peak     bf16 and fp32 matmul TFLOP/s measured beside the datasheet row MFU divides by
  fla      every fla kernel through our dispatch (asserting it ran), fp32 and bf16 (q, k, v in bf16, gates
           and states in fp32, as the mixers hand them under autocast), packed (cu_seqlens: the training
           path) and with initial states: GDN chunk (gdn's and derived_gdn's head shapes), GDN recurrent (one
           decoding step), linear attention, Mamba2's SSD via chunk_simple_gla (its B, C groups repeated to
           the heads); outputs, final states and gradients against our CPU path in float64. The head counts
           and widths are model=125m's, so the configs fla autotunes (cached on disk by Triton) are the ones
           stage train needs
  moe      MoE under bf16 autocast takes torch._grouped_mm; it matches the CPU expert loop, forward and backward
  dsa      the DSA ops on CUDA (top-k with documents, cuSPARSE SDDMM/SpMM, masked SDPA, indexer scores)
           against the CPU csr path; 1, 2 and 4 KV heads
  flex     FlexAttention with a document BlockMask against SDPA with the same boolean mask, fp32 and bf16,
           forward and backward, 12 query heads on 4 KV heads
  model    per mixer, 2 layers at model=125m's widths with document positions: CUDA fp32 loss and logits
           against the CPU; AdamW steps, then bf16 autocast logits against fp32 (norm-wise: DSA's top-k may
           flip on near-ties for a few tokens); greedy generate with the cache against the full forward
  compile  torch.compile logits against eager with document positions (softmax: FlexAttention; gdn: fla)
Stage train:
  plan     (CPU) each mixer's train.py config composes and validates; its 125m model's size and FLOPs/token
  data     the token cache the runs read, built once
  train    train.py model=125m at T=2048, batch 8, per mixer for an equal share of the time left (SIGTERM
           stops it): tokens/s and MFU (median over the log windows after the first), peak memory, the
           train loss falling from the first window to the last
"""
import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from common.files import written_then_renamed
from training.config import group_choices
from training.perf import GPU_PEAKS, cpu_contention_warning, cpu_peak, cuda_fp32_precision, gpu_peak

ROOT = Path(__file__).resolve().parents[1]
MIXERS = group_choices("mixer")
FWD_TOL, GRAD_TOL = 5e-3, 2e-2  # fp32, of max |reference|: Triton's fp32 dots run in tf32
BF16_FWD_TOL, BF16_GRAD_TOL = 3e-2, 6e-2  # bf16 inputs and intermediates (the reference gets the same bf16 inputs)
SETUP_S = 20  # imports and CUDA start-up before the first check: the budget's part no deadline bounds


# --- results ------------------------------------------------------------------------------------

class DeadlineExceeded(BaseException):
    """A check's deadline passed (a BaseException, so no `except Exception` inside a check catches it)."""


@contextmanager
def deadline(seconds: float):
    """Raises DeadlineExceeded in the main thread `seconds` from now (SIGALRM, between Python bytecodes)."""
    def alarm(signum, frame):
        raise DeadlineExceeded

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Check:
    name: str
    run: Callable[["Stage"], None]
    deadline_s: float
    needs_cuda: bool = True


class Stage:
    """Runs checks and keeps one row per case: {check, case, ok, problems, seconds} (+ measurements);
    `mixers` are the ones stage train trains, `plan` what check_plan found for each. `device`: where the
    CUDA checks put their tensors (tests/test_gpu_check.py runs some on "cpu" to exercise their code)."""

    def __init__(self, name: str, budget_s: float, cuda: bool, mixers: list[str] = MIXERS, device: str = "cuda"):
        self.name, self.budget_s, self.cuda, self.mixers, self.device = name, budget_s, cuda, mixers, device
        self.rows: list[dict] = []
        self.plan: dict[str, dict] = {}
        self.check, self.check_ends = "", math.inf
        self.t_start = time.perf_counter()

    def time_left(self) -> float:
        """Seconds until the running check's deadline."""
        return self.check_ends - time.perf_counter()

    def record(self, case: str, problems: list[str], seconds: float, **measured) -> None:
        self.rows.append({"check": self.check, "case": case, "ok": not problems, "problems": problems,
                          "seconds": round(seconds, 2), **measured})
        status = "ok" if not problems else f"{len(problems)} mismatch(es)"
        print(f"  {case}: {status} ({seconds:.1f} s)", flush=True)

    def case(self, name: str, fn: Callable[[], list[str | None] | None]) -> None:
        """Runs one case: fn returns its mismatch lines (None entries ignored); an exception is a mismatch."""
        t0 = time.perf_counter()
        try:
            problems = [line for line in (fn() or []) if line]
        except Exception as e:  # one failing case must not hide the others
            problems = [f"MISMATCH {self.check} {name}: raised {type(e).__name__}: {first_line(e)}"]
        self.record(name, problems, time.perf_counter() - t0)

    def run(self, checks: list[Check]) -> None:
        for check in checks:
            self.check = check.name
            if check.needs_cuda and not self.cuda:
                continue
            print(f"[{check.name}] deadline {check.deadline_s:g} s", flush=True)
            t0, before = time.perf_counter(), len(self.rows)
            self.check_ends = t0 + check.deadline_s
            try:
                with deadline(check.deadline_s):
                    check.run(self)
            except DeadlineExceeded:
                self.record("deadline", [f"MISMATCH {check.name}: its {check.deadline_s:g} s deadline passed after "
                                         f"{len(self.rows) - before} case(s); the rest did not run"], 0.0)
            except Exception as e:  # outside any case: set-up of the check itself
                self.record("setup", [f"MISMATCH {check.name}: raised {type(e).__name__}: {first_line(e)}"], 0.0)
            print(f"[{check.name}] {time.perf_counter() - t0:.1f} s", flush=True)

    def problems(self) -> list[str]:
        return [line for row in self.rows for line in row["problems"]]


def first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def summary_table(stage: Stage, checks: list[Check]) -> list[str]:
    lines = ["| check | cases | ok | mismatches | seconds | deadline s |", "|---|---|---|---|---|---|"]
    for check in checks:
        rows = [r for r in stage.rows if r["check"] == check.name]
        if check.needs_cuda and not stage.cuda:
            lines.append(f"| {check.name} | - | - | - | - | needs CUDA |")
            continue
        bad = sum(len(r["problems"]) for r in rows)
        lines.append(f"| {check.name} | {len(rows)} | {sum(r['ok'] for r in rows)} | {bad} | "
                     f"{sum(r['seconds'] for r in rows):.1f} | {check.deadline_s:.0f} |")
    return lines


def mismatch(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> str | None:
    """None when max |got - want| <= tol * max |want| (compared in float64 on the CPU), else one line
    naming the check, the error and the tolerance."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    if got.shape != want.shape:
        return f"MISMATCH {name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    bad = (~torch.isfinite(got)).sum().item()
    if bad:
        return f"MISMATCH {name}: {bad} non-finite values"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    if err <= tol * scale:
        return None
    return f"MISMATCH {name}: max |got - want| = {err:.3g} is {err / scale if scale else math.inf:.3g} of max |want| = {scale:.3g} (tolerance {tol:g})"


def norm_mismatch(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> str | None:
    """None when ||got - want|| <= tol ||want|| (2-norms over the whole tensor), else one line: an error
    spread over every value counts, a few values off (DSA's top-k flipping on near-ties) barely."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    ratio = ((got - want).norm() / want.norm()).item()
    return None if ratio <= tol else f"MISMATCH {name}: ||got - want|| is {ratio:.3g} of ||want|| (tolerance {tol:g})"


def scalar_mismatch(name: str, got: float, want: float, tol: float) -> str | None:
    """The same test for two numbers: |got - want| <= tol |want|."""
    return mismatch(name, torch.tensor([got]), torch.tensor([want]), tol)


@contextmanager
def counting(module_name: str, attr: str):
    """Wraps module.attr so that calls are counted (yields a one-element list); restores it after."""
    import importlib

    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    count = [0]

    def wrapper(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    setattr(module, attr, wrapper)
    try:
        yield count
    finally:
        setattr(module, attr, original)


# --- op inputs and runs -------------------------------------------------------------------------

CU_SEQLENS = [0, 100, 101, 350, 600]  # documents of 100, 1, 249 and 250 tokens: none a multiple of a chunk
LOW_PRECISION = ("q", "k", "v", "x", "dt", "B", "C")  # what the mixers hand the ops in bf16 under autocast


def _randn(seed: int, **shapes) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}


def gdn_inputs(T: int, seed: int = 0, B=2, H=4, K=64, V=128, state=True) -> dict:
    x = _randn(seed, q=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V), g=(B, T, H), beta=(B, T, H), initial_state=(B, H, K, V))
    x["q"], x["k"] = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)
    x["g"], x["beta"] = F.logsigmoid(x["g"] + 3), x["beta"].sigmoid()
    x["initial_state"] = 0.1 * x["initial_state"] if state else None
    return x


def linear_inputs(T: int, seed: int = 0, B=2, H=4, K=64, V=64, state=True) -> dict:
    x = _randn(seed, q=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V), S0=(B, H, K, V), z0=(B, 8, H, K))
    x["q"], x["k"] = F.elu(x["q"]) + 1, F.elu(x["k"]) + 1
    x["S0"], x["z0"] = (0.1 * x["S0"], (F.elu(x["z0"]) + 1).sum(1)) if state else (None, None)
    return x


def ssd_inputs(T: int, seed: int = 0, B=2, H=4, P=64, G=2, N=64, state=True) -> dict:
    x = _randn(seed, x=(B, T, H, P), dt=(B, T, H), A=(H,), B=(B, T, G, N), C=(B, T, G, N), D=(H,), dt_bias=(H,),
               initial_states=(B, H, P, N))
    x["A"], x["dt_bias"] = -torch.exp(x["A"]), 0.5 * x["dt_bias"] - 3
    x["initial_states"] = 0.1 * x["initial_states"] if state else None
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


def op_gdn_chunk(q, k, v, g, beta, initial_state=None, cu_seqlens=None):
    from model.ops.gated_delta import chunk_gated_delta_rule

    o, S = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                  cu_seqlens=cu_seqlens)
    return {"o": o, "state": S}


def op_gdn_recurrent(q, k, v, g, beta, initial_state=None):
    from model.ops.gated_delta import fused_recurrent_gated_delta_rule

    o, S = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)
    return {"o": o, "state": S}


def op_linear(normalize: bool):
    def run(q, k, v, S0=None, z0=None, cu_seqlens=None):
        from model.ops.linear_attention import chunk_linear_attn

        state = None if S0 is None else ((S0, z0) if normalize else S0)
        o, final = chunk_linear_attn(q, k, v, initial_state=state, output_final_state=True, normalize=normalize,
                                     cu_seqlens=cu_seqlens)
        return {"o": o, "state": final[0] if normalize else final}
    return run


def op_ssd(x, dt, A, B, C, D, dt_bias, initial_states=None, cu_seqlens=None):
    from model.ops.ssd import mamba_chunk_scan

    y, S = mamba_chunk_scan(x, dt, A, B, C, 64, D=D, dt_bias=dt_bias, dt_softplus=True,
                            initial_states=initial_states, return_final_states=True, cu_seqlens=cu_seqlens)
    return {"y": y, "state": S}


# --- stage kernels ------------------------------------------------------------------------------

def check_cpu(stage: Stage) -> None:
    """Our CPU paths against each other (float64); the CPU peak and contention, the GPU peak table."""
    from model.ops.ssd import mamba_state_step

    f64, cpu = torch.float64, torch.device("cpu")
    x = gdn_inputs(T=45, K=16, V=32)
    stage.case("gdn chunk vs recurrent", lambda: compare_runs(
        "cpu gdn chunk vs recurrent", run_op(op_gdn_chunk, x, cpu, f64), run_op(op_gdn_recurrent, x, cpu, f64)))

    def ssd_stepped(x, dt, A, B, C, D, dt_bias, initial_states):
        state, ys = initial_states, []
        for t in range(x.shape[1]):
            y, state = mamba_state_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], state, D=D, dt_bias=dt_bias, dt_softplus=True)
            ys.append(y)
        return {"y": torch.stack(ys, 1), "state": state}

    s = ssd_inputs(T=45, P=8, N=16)
    stage.case("ssd chunk vs step", lambda: compare_runs(
        "cpu ssd chunk vs step", run_op(op_ssd, s, cpu, f64), run_op(ssd_stepped, s, cpu, f64)))

    def linear_as_ssd_step(q, k, v, S0, z0):  # S_t = S_{t-1} + k v^T is the SSD step with dt = 1, A = 0, D = 0
        state, ys = S0.transpose(-1, -2), []
        one, zero = q.new_ones(q.shape[0], q.shape[2]), q.new_zeros(q.shape[2])
        for t in range(q.shape[1]):
            y, state = mamba_state_step(v[:, t], one, zero, k[:, t], q[:, t] * q.shape[-1] ** -0.5, state)
            ys.append(y)
        return {"o": torch.stack(ys, 1), "state": state.transpose(-1, -2)}

    lin = linear_inputs(T=45, K=16, V=8)
    stage.case("linear chunk vs ssd step", lambda: compare_runs(
        "cpu linear chunk vs ssd step", run_op(op_linear(False), lin, cpu, f64), run_op(linear_as_ssd_step, lin, cpu, f64)))

    print(f"  {cpu_peak().describe()}")
    print(f"  CPU contention: {cpu_contention_warning() or f'none seen ({torch.get_num_threads()} torch threads)'}")
    print("  GPU peak table (dense TFLOP/s, datasheet; bf16 and tf32 on tensor cores, fp32 on CUDA cores):")
    for row in GPU_PEAKS:
        print(f"    {row.label:26s} bf16 {row.bf16 or '-':>7} tf32 {row.tf32 or '-':>7} fp32 {row.fp32:>6}   /{row.pattern}/")


def measured_matmul_tflops(dtype, n: int, repeats: int = 20) -> float:
    """Best TFLOP/s of an n^3 matmul on the current CUDA device, timed with CUDA events."""
    a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    best = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * n**3 / best / 1e12


def check_peak(stage: Stage) -> None:
    """The table's peak beside a measured matmul: a measurement above the datasheet means a wrong row."""
    name = torch.cuda.get_device_name()
    for precision, dtype, n in (("bf16", torch.bfloat16, 8192), (cuda_fp32_precision(), torch.float32, 4096)):
        def measure(precision=precision, dtype=dtype, n=n):
            table = gpu_peak(name, precision)
            got = measured_matmul_tflops(dtype, n)
            ratio = f" = {got * 1e12 / table.flops:.0%} of the table" if table.flops else ""
            print(f"  {name} {precision}: measured {got:,.1f} TFLOP/s ({n}^3 matmul){ratio}; table: {table.describe()}")
            if table.flops and got * 1e12 > 1.05 * table.flops:
                return [f"MISMATCH peak {precision}: measured {got:.1f} TFLOP/s exceeds the table's {table.flops / 1e12:.1f} on {name!r}"]
            return []
        stage.case(precision, measure)


def training_model_config(mixer: str, vocab_size: int | None = None, overrides: tuple[str, ...] = ()):
    """The LMConfig stage train builds for `mixer` (model=125m; vocab from the data config unless given),
    with train.py `overrides` on top."""
    from scripts.sweep import compose
    from training.config import lm_config

    cfg = compose(["model=125m", f"mixer={mixer}", *overrides])
    return lm_config(cfg, vocab_size or cfg.data.vocab_size, 0)


def kernel_shapes() -> dict:
    """The fla calls' head counts and widths in a model=125m layer of each mixer that has them."""
    from model import MIXERS

    with torch.device("meta"):
        gdn, derived, linear, mamba2 = (MIXERS.get(m)(training_model_config(m), 0)
                                        for m in ("gdn", "derived_gdn", "linear", "mamba2"))
    return {"gdn": dict(H=gdn.num_v_heads, K=gdn.head_dim, V=gdn.head_v_dim),  # q, k repeated to the value heads
            "derived_gdn": dict(H=derived.num_heads, K=derived.head_dim, V=derived.head_dim),
            "linear": dict(H=linear.num_heads, K=linear.head_dim, V=linear.head_dim),
            "mamba2": dict(H=mamba2.num_heads, P=mamba2.head_dim, G=mamba2.n_groups, N=mamba2.state_size)}


def kernel_cases() -> list[tuple]:
    """(name, op, inputs, gradient inputs, fla module, fla function, bf16?) for every case of check_fla:
    each kernel packed (cu_seqlens, B = 1) and with initial states (B = 2, T = 300), fp32 and bf16."""
    shapes = kernel_shapes()
    T = CU_SEQLENS[-1]
    GDN, LIN, SSD = "fla.ops.gated_delta_rule", "fla.ops.linear_attn", "fla.ops.simple_gla"
    gdn_grads, lin_grads = ("q", "k", "v", "g", "beta"), ("q", "k", "v")
    ssd_grads = ("x", "dt", "A", "B", "C", "D", "dt_bias")
    cases = []
    for bf16 in (False, True):
        p = "bf16" if bf16 else "fp32"
        cases += [
            (f"gdn chunk packed {p}", op_gdn_chunk, packed(gdn_inputs(T, B=1, state=False, **shapes["gdn"])), gdn_grads,
             GDN, "chunk_gated_delta_rule", bf16),
            (f"gdn chunk initial state {p}", op_gdn_chunk, gdn_inputs(300, **shapes["gdn"]), gdn_grads + ("initial_state",),
             GDN, "chunk_gated_delta_rule", bf16),
            (f"derived_gdn chunk packed {p}", op_gdn_chunk, packed(gdn_inputs(T, B=1, state=False, **shapes["derived_gdn"])),
             gdn_grads, GDN, "chunk_gated_delta_rule", bf16),
            (f"gdn recurrent one step {p}", op_gdn_recurrent, gdn_inputs(1, **shapes["gdn"]), (),
             GDN, "fused_recurrent_gated_delta_rule", bf16),
            (f"linear packed {p}", op_linear(True), packed(linear_inputs(T, B=1, state=False, **shapes["linear"])), lin_grads,
             LIN, "chunk_linear_attn", bf16),
            (f"linear initial state {p}", op_linear(True), linear_inputs(300, **shapes["linear"]), lin_grads + ("S0", "z0"),
             LIN, "chunk_linear_attn", bf16),
            (f"mamba2 ssd packed {p}", op_ssd, packed(ssd_inputs(T, B=1, state=False, **shapes["mamba2"])), ssd_grads,
             SSD, "chunk_simple_gla", bf16),
            (f"mamba2 ssd initial state {p}", op_ssd, ssd_inputs(300, **shapes["mamba2"]), ssd_grads + ("initial_states",),
             SSD, "chunk_simple_gla", bf16),
        ]
    return cases


def check_fla(stage: Stage) -> None:
    """Each fla kernel through our dispatch on CUDA against our CPU path in float64, asserting it ran."""
    try:
        import fla  # noqa: F401
    except ImportError as e:
        stage.record("import", [f"MISMATCH fla: does not import ({e}); pip install -r requirements-gpu.txt"], 0.0)
        return
    dev, cpu = torch.device(stage.device), torch.device("cpu")
    for name, op, inputs, grads, module, attr, bf16 in kernel_cases():
        def run(name=name, op=op, inputs=inputs, grads=grads, module=module, attr=attr, bf16=bf16):
            low = torch.bfloat16 if bf16 else None
            want = run_op(op, rounded(inputs, low) if bf16 else inputs, cpu, torch.float64, grads)
            with counting(module, attr) as calls:
                got = run_op(op, inputs, dev, torch.float32, grads, low=low)
            ran = [] if calls[0] else [f"MISMATCH fla {name}: {module}.{attr} did not run (the dispatch took the PyTorch path)"]
            return ran + compare_runs(f"fla {name}", got, want, bf16)
        stage.case(name, run)


def check_moe(stage: Stage) -> None:
    """MoE at model=125m's widths under bf16 autocast on CUDA runs torch._grouped_mm (the guard admits it),
    and experts_grouped_mm matches the CPU expert loop (float64, same bf16-rounded operands), fwd + bwd."""
    from model.ffn import FFNS
    from model.ffn.moe import ExpertsLoop, experts_grouped_mm

    def dispatch():
        torch.manual_seed(0)
        moe = FFNS.get("moe")(training_model_config("softmax", overrides=("ffn=moe",)), 0)
        moe.init_parameters()
        moe.to(stage.device)
        x = torch.randn(2, 256, moe.hidden_size, device=stage.device)
        with counting("model.ffn.moe", "experts_grouped_mm") as calls, torch.autocast(stage.device, torch.bfloat16):
            moe(x).float().sum().backward()
        return [] if calls[0] else ["MISMATCH moe: bf16 autocast on CUDA did not run torch._grouped_mm"]

    def against_loop():
        g = torch.Generator().manual_seed(0)
        E, d, f = 8, 768, 1024
        counts = torch.tensor([300, 0, 17, 512, 1, 64, 128, 2])  # an expert with no rows, odd group sizes
        xs, w_gu, w_d = (0.05 * torch.randn(*s, generator=g) for s in ((int(counts.sum()), d), (E, d, 2 * f), (E, f, d)))
        xs, w_gu, w_d = (t.bfloat16() for t in (xs, w_gu, w_d))
        w = torch.randn(int(counts.sum()), d, generator=g)
        leaves = [t.double().requires_grad_() for t in (xs, w_gu, w_d)]
        ref = ExpertsLoop.apply(*leaves, counts.tolist())
        want = [ref.detach(), *torch.autograd.grad((ref * w.double()).sum(), leaves)]
        leaves = [t.to(stage.device).requires_grad_() for t in (xs, w_gu, w_d)]
        out = experts_grouped_mm(*leaves, counts.to(stage.device))
        got = [out.detach(), *torch.autograd.grad((out.float() * w.to(stage.device)).sum(), leaves)]
        return [mismatch(f"moe grouped mm {name}", a, b, BF16_FWD_TOL if name == "ys" else BF16_GRAD_TOL)
                for name, a, b in zip(("ys", "dxs", "dw_gu", "dw_d"), got, want)]

    stage.case("bf16 autocast takes torch._grouped_mm", dispatch)
    stage.case("grouped mm vs CPU loop, fwd + bwd", against_loop)


def check_dsa(stage: Stage, T: int = 300, topk: int = 32) -> None:
    """The DSA ops on `device` against the CPU csr path for the same fp32 inputs with two documents per row:
    top-k selection (compared by selected score values: ties may pick other keys), the sparse path
    (cuSPARSE SDDMM / SpMM on CUDA), the masked path and the dispatch (outputs and q, k, v gradients), the
    indexer scores at the selection (values and gradients); 1, 2 and 4 KV heads."""
    import model.ops.sparse_attention as sa

    H, D, H_I, D_I = 4, 64, 4, 32
    device = stage.device
    segment_ids = torch.cat([torch.zeros(T // 3, dtype=torch.long), torch.ones(T - T // 3, dtype=torch.long)]).expand(2, T)

    def compare(name, cpu, dev, tol=1e-4):
        return [f"MISMATCH dsa {name} [{i}]: max |diff| {(a - b.cpu()).abs().max().item():.3g}"
                for i, (a, b) in enumerate(zip(cpu, dev)) if not torch.allclose(a, b.cpu(), atol=tol, rtol=tol)]

    def run_op(op, inputs, on):
        xs = [t.detach().to(on).requires_grad_() for t in inputs]
        out = op(*xs)
        g = torch.Generator().manual_seed(1)
        (out * torch.randn(out.shape, generator=g).to(on).nan_to_num()).nan_to_num(posinf=0, neginf=0).sum().backward()
        return [out.detach().nan_to_num(posinf=0, neginf=0)] + [t.grad for t in xs]

    def csr(idx, S, on):  # the csr backend on either device (on the CPU the default is numba)
        return sa.Selection(idx.to(on), S, "csr")

    for kv in (1, 2, H):
        def case(kv=kv):
            g = torch.Generator().manual_seed(kv)
            q, k, v = (torch.randn(2, T, n, D, generator=g) for n in (H, kv, kv))
            q_i, k_i, w = (torch.randn(2, T, *shape, generator=g) for shape in ((H_I, D_I), (D_I,), (H_I,)))
            idx = sa.index_topk(q_i, k_i, w, topk, segment_ids=segment_ids)
            idx_dev = sa.index_topk(q_i.to(device), k_i.to(device), w.to(device), topk,
                                    segment_ids=segment_ids.to(device)).cpu()
            scores = sa.index_scores(q_i, k_i, w, segment_ids=segment_ids)
            picked = lambda i: scores.gather(-1, i.clamp(min=0)).masked_fill(i < 0, 0).sort(-1).values  # noqa: E731
            out = compare(f"index_topk, {kv} KV heads", [picked(idx)], [picked(idx_dev)])
            ops = {"sparse path": lambda a, b, c: sa.sparse_attention(a, b, c, csr(idx, T, a.device)),
                   "masked path": lambda a, b, c: sa.masked_attention(a, b, c, idx.to(a.device)),
                   "selected_attention": lambda a, b, c: sa.selected_attention(a, b, c, csr(idx, T, a.device))[0]}
            for name, op in ops.items():
                out += compare(f"{name}, {kv} KV heads", run_op(op, (q, k, v), "cpu"), run_op(op, (q, k, v), device))
            scores_at = lambda a, b, c: sa.index_scores_at(a, b, c, csr(idx, T, a.device))  # noqa: E731
            return out + compare(f"index_scores_at, {kv} KV heads", run_op(scores_at, (q_i, k_i, w), "cpu"),
                                 run_op(scores_at, (q_i, k_i, w), device))
        stage.case(f"{kv} KV heads", case)


def document_positions(B: int, T: int) -> torch.Tensor:
    """position_ids [B, T] of packed documents: row b holds documents of T // 5, 1, T // 2 tokens and the rest
    (shifted by b, so the rows differ), row 1 starting mid-document."""
    rows = []
    for b in range(B):
        lengths = [T // 5 + b, 1, T // 2]
        lengths.append(T - sum(lengths))
        row = torch.cat([torch.arange(n) for n in lengths])
        rows.append(row + (7 if b == 1 else 0) * (torch.arange(T) < lengths[0]))
    return torch.stack(rows)


def check_flex(stage: Stage) -> None:
    """`attend` with document segments on CUDA (FlexAttention with the BlockMask) against SDPA with the
    boolean same-document causal mask, fp32 and bf16, outputs and q, k, v gradients, GQA 12 / 4 heads."""
    from model.layers import DocumentSegments
    from model.mixers.softmax import attend

    B, H, Hkv, T, D = 2, 12, 4, 600, 64
    positions = document_positions(B, T)
    mask = DocumentSegments(positions).attention_mask.to(stage.device)  # [B, 1, T, T] bool, the CPU path's mask

    for dtype, tol in ((torch.float32, FWD_TOL), (torch.bfloat16, BF16_FWD_TOL)):
        def case(dtype=dtype, tol=tol):
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(B, n, T, D, generator=g).to(stage.device, dtype) for n in (H, Hkv, Hkv))
            w = torch.randn(B, H, T, D, generator=g).to(stage.device)
            segments = DocumentSegments(positions.to(stage.device))
            results = []
            for use_flex in (True, False):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                if use_flex:
                    with counting("model.mixers.softmax", "_flex_attention") as calls:
                        o = attend(*leaves, segments)
                else:
                    o = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
                results.append([o.detach(), *torch.autograd.grad((o.float() * w).sum(), leaves)])
            ran = [] if calls[0] else ["MISMATCH flex: attend did not call FlexAttention on CUDA"]
            return ran + [mismatch(f"flex {dtype} {name}", a, b, tol if name == "o" else 2 * tol)
                          for name, a, b in zip(("o", "dq", "dk", "dv"), *results)]
        stage.case(f"{str(dtype).removeprefix('torch.')}", case)


def small_model(mixer: str, vocab: int):
    """The mixer at its default options in 2 layers of model=125m's widths, 4 KV heads (GQA)."""
    from model import DecoderLM

    torch.manual_seed(0)
    return DecoderLM(training_model_config(mixer, vocab, ("model.num_hidden_layers=2", "model.num_key_value_heads=4")))


def check_model(stage: Stage) -> None:
    """Per mixer on a 2-layer model with document positions: CUDA fp32 vs CPU fp32 loss and logits; after a
    few AdamW steps on CUDA (the loss falls), bf16 autocast logits vs fp32; greedy generate with the cache vs
    the full forward."""
    vocab, T = 512, 256
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, T), generator=g)
    held_out = torch.randint(0, vocab, (2, T), generator=g)
    positions = document_positions(2, T)
    for mixer in MIXERS:
        def case(mixer=mixer):
            model = small_model(mixer, vocab).eval()
            out = []
            with torch.no_grad():
                ref = model(ids, labels=ids, position_ids=positions, use_cache=False)
                model.to(stage.device)
                x, pos = ids.to(stage.device), positions.to(stage.device)
                fp32 = model(x, labels=x, position_ids=pos, use_cache=False)
            out.append(scalar_mismatch(f"model {mixer} cuda fp32 loss vs cpu", fp32.loss.item(), ref.loss.item(), 2e-3))
            out.append(mismatch(f"model {mixer} cuda fp32 logits vs cpu", fp32.logits, ref.logits, 1e-2))
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            losses = []
            for _ in range(6):
                loss = model(x, labels=x, position_ids=pos, use_cache=False).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            if not losses[-1] < losses[0]:
                out.append(f"MISMATCH model {mixer}: the loss did not fall over 6 AdamW steps ({losses[0]:.3f} -> {losses[-1]:.3f})")
            model.eval()
            y, ypos = held_out.to(stage.device), pos
            with torch.no_grad():
                trained = model(y, position_ids=ypos, use_cache=False).logits
                with torch.autocast(stage.device, dtype=torch.bfloat16):
                    bf16 = model(y, position_ids=ypos, use_cache=False).logits
                out.append(norm_mismatch(f"model {mixer} bf16 autocast logits vs fp32 after 6 steps", bf16, trained, 5e-2))
                prompt = y[:1, :32]
                gen = model.generate(prompt, max_new_tokens=16, do_sample=False, use_cache=True, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=0)
                full = model(gen.sequences).logits[:, prompt.shape[1] - 1:-1]
                out.append(mismatch(f"model {mixer} generate with cache vs full forward logits",
                                    torch.stack(gen.logits, 1), full, 1e-2))
            return out
        stage.case(mixer, case)


COMPILE_MIXERS = ("softmax", "gdn")  # FlexAttention inside the graph; fla behind its graph break


def check_compile(stage: Stage) -> None:
    """torch.compile logits against eager, fp32, document positions."""
    vocab, T = 512, 256
    ids = torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(0)).to(stage.device)
    positions = document_positions(2, T).to(stage.device)
    for mixer in COMPILE_MIXERS:
        def case(mixer=mixer):
            model = small_model(mixer, vocab).to(stage.device).eval()
            with torch.no_grad():
                eager = model(ids, position_ids=positions, use_cache=False).logits
                compiled = torch.compile(model)(ids, position_ids=positions, use_cache=False).logits
            return [mismatch(f"compile {mixer} logits vs eager", compiled, eager, 1e-3)]
        stage.case(mixer, case)


KERNEL_CHECKS = [Check("cpu", check_cpu, 15, needs_cuda=False), Check("peak", check_peak, 10),
                 Check("fla", check_fla, 95), Check("moe", check_moe, 10), Check("dsa", check_dsa, 20),
                 Check("flex", check_flex, 20), Check("model", check_model, 30), Check("compile", check_compile, 20)]


# --- stage train --------------------------------------------------------------------------------

TRAIN_T, TRAIN_BATCH, LOG_EVERY = 2048, 8, 5
STOP_GRACE_S = 8  # after SIGTERM, for train.py to finish its step and save before it is killed


def train_overrides(mixer: str, run_dir: Path | str) -> list[str]:
    """train.py's overrides for one run: model=125m at T=2048, more steps than fit (the run is stopped)."""
    return ["model=125m", f"mixer={mixer}", "logger=none", f"trainer.seq_len={TRAIN_T}",
            f"trainer.batch_size={TRAIN_BATCH}", "trainer.max_steps=100000", "trainer.warmup_steps=10",
            f"trainer.log_every={LOG_EVERY}", "trainer.eval_every=100000", "trainer.eval_batches=1",
            "trainer.ckpt_every=100000", "trainer.sample_tokens=0", f"run_dir={run_dir}"]


def check_plan(stage: Stage) -> None:
    """Each mixer's train.py config composes and passes train.py's validation; its model's size and FLOPs."""
    from model import DecoderLM
    from scripts.sweep import compose
    from training.config import lm_config
    from training.validation import check_train_config

    for mixer in stage.mixers:
        def case(mixer=mixer):
            cfg = compose(train_overrides(mixer, "unused"))
            check_train_config(cfg)
            with torch.device("meta"):
                model = DecoderLM(lm_config(cfg, cfg.data.vocab_size, 0))
            params = model.parameter_counts()["total"]
            flops = model.flops_per_token(TRAIN_T)
            print(f"    {mixer}: {params / 1e6:.1f}M parameters, {flops / 1e9:.2f} GFLOP/token forward at T={TRAIN_T}")
            stage.plan[mixer] = {"parameters": params, "forward_flops_per_token": flops}
        stage.case(mixer, case)


def check_data(stage: Stage) -> None:
    """The token cache every run reads (data's default config), built here once rather than in the first run."""
    from data import build_data
    from scripts.sweep import compose

    def build():
        cfg = compose(train_overrides(stage.mixers[0], "unused"))
        data = build_data(cfg.data, TRAIN_T, cfg.seed)
        print(f"    {len(data.train)} train sequences of {TRAIN_T} tokens")
    stage.case("token cache", build)


def summarize_run(rows: list[dict]) -> tuple[dict, list[str]]:
    """A run's measurements from its metrics.jsonl rows: tokens/s and MFU (medians over the log windows
    after the first, which holds compilation and autotuning), peak memory, first and last window's train
    loss; and its problems (fewer than two windows, a loss that did not fall, an MFU above 1)."""
    logged = [r for r in rows if "perf/tokens_per_sec" in r]
    if len(logged) < 2:
        return {"windows": len(logged)}, [f"only {len(logged)} log window(s) of {LOG_EVERY} steps in the time given"]
    later = logged[1:]
    median = lambda key: sorted(r[key] for r in later)[len(later) // 2] if key in later[0] else None  # noqa: E731
    result = {"windows": len(logged), "steps": logged[-1].get("step"), "tokens_per_sec": median("perf/tokens_per_sec"),
              "mfu": median("perf/mfu"), "peak_mem_gb": max(r["perf/peak_mem_gb"] for r in logged),
              "loss_first": logged[0]["train/loss"], "loss_last": logged[-1]["train/loss"]}
    problems = []
    if not result["loss_last"] < result["loss_first"]:
        problems.append(f"train loss did not fall ({result['loss_first']:.3f} -> {result['loss_last']:.3f})")
    if result["mfu"] is not None and result["mfu"] > 1:
        problems.append(f"MFU {result['mfu']:.2f} > 1 (the FLOP count or the peak table is wrong)")
    return result, problems


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (train.py saves and exits after its step), then SIGKILL after STOP_GRACE_S."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def check_train(stage: Stage) -> None:
    """train.py model=125m per mixer, each for an equal share of the stage's time left."""
    from training.metrics import read_metrics

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for i, mixer in enumerate(stage.mixers):
            slot = (stage.time_left() - 5) / (len(stage.mixers) - i)  # 5 s for the summary
            t0 = time.perf_counter()
            run_dir = Path(tmp) / mixer
            log = Path(tmp) / f"{mixer}.log"  # a file, not a pipe: nothing reads it while train.py runs
            with log.open("w") as out:
                proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *train_overrides(mixer, run_dir)],
                                        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=out, stderr=out)
            try:
                proc.wait(max(slot - STOP_GRACE_S, 1))
                ended = "exited by itself"
            except subprocess.TimeoutExpired:
                ended = "stopped"
            finally:
                stop(proc)
            seconds = time.perf_counter() - t0
            rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
            result, problems = summarize_run(rows)
            if ended == "exited by itself" and proc.returncode:
                problems.insert(0, f"train.py exited {proc.returncode}: {(log.read_text().strip().splitlines() or ['no output'])[-1]}")
            stage.record(mixer, [f"MISMATCH train {mixer}: {p}" for p in problems], seconds, slot_s=round(slot, 1), **result)


def train_table(stage: Stage) -> list[str]:
    lines = ["| mixer | tokens/s | MFU | peak mem GB | train loss (first -> last window) | steps | s |",
             "|---|---|---|---|---|---|---|"]
    for r in (r for r in stage.rows if r["check"] == "train" and "tokens_per_sec" in r):
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(f"| {r['case']} | {r['tokens_per_sec']:,.0f} | {mfu} | {r['peak_mem_gb']:.1f} | "
                     f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} | {r['steps']} | {r['seconds']:.0f} |")
    return lines


TRAIN_CHECKS = [Check("plan", check_plan, 30, needs_cuda=False), Check("data", check_data, 60),
                Check("train", check_train, 185)]
STAGES = {"kernels": (240, KERNEL_CHECKS), "train": (300, TRAIN_CHECKS)}  # budget s on one H100/H200, checks


def environment(cuda: bool) -> dict:
    import importlib.metadata as md

    def version(package):
        try:
            return md.version(package)
        except md.PackageNotFoundError:
            return None

    return {"torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "triton": version("triton"),
            "flash-linear-attention": version("flash-linear-attention")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", required=True, choices=tuple(STAGES))
    parser.add_argument("--mixers", nargs="+", default=MIXERS, choices=MIXERS, metavar="MIXER",
                        help=f"stage train: the mixers to train (default: all of {', '.join(MIXERS)})")
    parser.add_argument("--json", type=Path, default=None, help="results file (default: outputs/gpu_check/<stage>.json)")
    args = parser.parse_args(argv)

    budget, checks = STAGES[args.stage]
    cuda = torch.cuda.is_available()
    env = environment(cuda)
    print(f"gpu_check stage {args.stage}: budget {budget // 60} min {budget % 60:02d} s on one H100/H200 "
          f"({SETUP_S} s start-up + check deadlines {' + '.join(f'{c.name} {c.deadline_s:.0f}' for c in checks)} s)")
    print(" | ".join(f"{k} {v}" for k, v in env.items() if v))
    stage = Stage(args.stage, budget, cuda, args.mixers)
    stage.run(checks)

    print(f"\nsummary: stage {args.stage}, {time.perf_counter() - stage.t_start:.1f} s of its {budget} s budget")
    print("\n".join(summary_table(stage, checks)))
    if args.stage == "train" and cuda:
        print("\n".join(train_table(stage)))
    if not cuda:
        print("CUDA is not available: ran the CPU part only. " + ", ".join(c.name for c in checks if c.needs_cuda) +
              " need a CUDA GPU with requirements-gpu.txt installed.")
    problems = stage.problems()
    path = args.json or ROOT / "outputs" / "gpu_check" / f"{args.stage}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_then_renamed(path) as tmp:
        tmp.write_text(json.dumps({"stage": args.stage, "budget_s": budget, "seconds": round(time.perf_counter() - stage.t_start, 1),
                                   "passed": not problems, **env, "plan": stage.plan, "results": stage.rows}, indent=1))
    print(f"results: {path}")
    for line in problems:
        print(line)
    print(f"{len(problems)} mismatch(es)" if problems else "all checks passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
