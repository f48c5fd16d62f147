"""GPU self-check: every fast path against our CPU reference path on identical inputs, then a short
`model=125m` training run per mixer through train.py.

    python scripts/gpu_check.py                         # everything (CUDA: budgeted for < 10 min on one H100/H200)
    python scripts/gpu_check.py --train-steps 0         # the kernel and model checks only
    python scripts/gpu_check.py --train-mixers gdn mamba2

Checks, in order (each prints its wall time):
  cpu      our CPU paths agree with each other in float64 (chunked GDN vs its recurrence, chunked linear
           attention vs the SSD step with no decay, chunked SSD vs its step), the CPU matmul peak used for
           MFU and whether other processes contend for the cores; the GPU peak table
  peak     (CUDA) bf16 and fp32 matmul TFLOP/s measured beside the table's datasheet value
  kernels  (CUDA) fla's chunk and fused-recurrent gated delta rule, chunk linear attention and
           chunk_simple_gla (the Mamba2 SSD) via model/ops' dispatch, fp32 on the GPU against our CPU path
           in float64: outputs, final states, gradients; each asserts that the fla kernel really ran
  model    (CUDA) per mixer, a 2-layer model: CUDA fp32 loss vs CPU fp32, bf16 autocast loss vs fp32,
           greedy generate with the cache vs the full forward's logits; torch.compile logits vs eager
  train    (CUDA) train.py model=125m at T=2048 for --train-steps steps per mixer: tokens/s, MFU, peak memory

Exit status: 0 when every check that ran passed (without CUDA only the cpu checks run, and the output
says which checks need CUDA); 1 on any mismatch, with one "MISMATCH <check>: ..." line per mismatch.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from training.config import group_choices
from training.perf import GPU_PEAKS, cpu_contention_warning, cpu_peak, cuda_fp32_precision, gpu_peak

ROOT = Path(__file__).resolve().parents[1]

MIXERS = group_choices("mixer")
COMPILE_MIXERS = ("softmax", "gdn", "mamba2")  # one per kernel family (SDPA, fla GDN, fla simple GLA): compiling is slow
FWD_TOL, GRAD_TOL = 5e-3, 2e-2  # of max |reference|: Triton's fp32 dots run in tf32


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

def gdn_inputs(T: int, seed: int = 0, B=2, H=4, K=64, V=128) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {"q": F.normalize(r(B, T, H, K), dim=-1), "k": F.normalize(r(B, T, H, K), dim=-1), "v": r(B, T, H, V),
            "g": F.logsigmoid(r(B, T, H) + 3), "beta": r(B, T, H).sigmoid(), "initial_state": 0.1 * r(B, H, K, V)}


def linear_inputs(T: int, seed: int = 0, B=2, H=4, K=64, V=64) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {"q": F.elu(r(B, T, H, K)) + 1, "k": F.elu(r(B, T, H, K)) + 1, "v": r(B, T, H, V),
            "S0": 0.1 * r(B, H, K, V), "z0": (F.elu(r(B, 8, H, K)) + 1).sum(1)}


def ssd_inputs(T: int, seed: int = 0, B=2, H=4, P=64, G=2, N=64) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {"x": r(B, T, H, P), "dt": r(B, T, H), "A": -torch.exp(r(H)), "B": r(B, T, G, N), "C": r(B, T, G, N),
            "D": r(H), "dt_bias": 0.5 * r(H) - 3, "initial_states": 0.1 * r(B, H, P, N)}


def run_op(fn, inputs: dict, device, dtype, grads: tuple[str, ...] = (), seed: int = 1) -> dict:
    """fn(**inputs) -> {name: tensor} on `device` in `dtype`; with `grads`, also d<name> for those inputs
    of the loss sum_i <out_i, w_i> with fixed random w_i. Everything returned is on the CPU."""
    leaves = {k: v.to(device=device, dtype=dtype).requires_grad_(k in grads) for k, v in inputs.items()}
    outs = fn(**leaves)
    result = {k: v.detach().cpu() for k, v in outs.items()}
    if grads:
        g = torch.Generator().manual_seed(seed)
        loss = sum((v.float() * torch.randn(v.shape, generator=g).to(v.device)).sum() for _, v in sorted(outs.items()))
        loss.backward()
        result.update({f"d{k}": leaves[k].grad.cpu() for k in grads})
    return result


def compare_runs(name: str, got: dict, want: dict) -> list[str]:
    return [line for key in want
            if (line := mismatch(f"{name} {key}", got[key], want[key], GRAD_TOL if key.startswith("d") else FWD_TOL))]


def op_gdn_chunk(q, k, v, g, beta, initial_state):
    from model.ops.gated_delta import chunk_gated_delta_rule

    o, S = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)
    return {"o": o, "state": S}


def op_gdn_recurrent(q, k, v, g, beta, initial_state):
    from model.ops.gated_delta import fused_recurrent_gated_delta_rule

    o, S = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)
    return {"o": o, "state": S}


def op_linear(normalize: bool):
    def run(q, k, v, S0, z0):
        from model.ops.linear_attention import chunk_linear_attn

        o, state = chunk_linear_attn(q, k, v, initial_state=(S0, z0) if normalize else S0, output_final_state=True,
                                     normalize=normalize)
        return {"o": o, "state": state[0] if normalize else state}
    return run


def op_ssd(x, dt, A, B, C, D, dt_bias, initial_states):
    from model.ops.ssd import mamba_chunk_scan

    y, S = mamba_chunk_scan(x, dt, A, B, C, 64, D=D, dt_bias=dt_bias, dt_softplus=True,
                            initial_states=initial_states, return_final_states=True)
    return {"y": y, "state": S}


# --- checks -------------------------------------------------------------------------------------

def check_cpu() -> list[str]:
    """Our CPU paths against each other (float64), the CPU peak and contention, the GPU peak table."""
    from model.ops.ssd import mamba_state_step

    f64, cpu = torch.float64, torch.device("cpu")
    out = []
    x = gdn_inputs(T=45, K=16, V=32)
    out += compare_runs("cpu gdn chunk vs recurrent", run_op(op_gdn_chunk, x, cpu, f64), run_op(op_gdn_recurrent, x, cpu, f64))

    def ssd_stepped(x, dt, A, B, C, D, dt_bias, initial_states):
        state, ys = initial_states, []
        for t in range(x.shape[1]):
            y, state = mamba_state_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], state, D=D, dt_bias=dt_bias, dt_softplus=True)
            ys.append(y)
        return {"y": torch.stack(ys, 1), "state": state}

    x = ssd_inputs(T=45, P=8, N=16)
    out += compare_runs("cpu ssd chunk vs step", run_op(op_ssd, x, cpu, f64), run_op(ssd_stepped, x, cpu, f64))

    def linear_as_ssd_step(q, k, v, S0, z0):  # S_t = S_{t-1} + k v^T is the SSD step with dt = 1, A = 0, D = 0
        state, ys = S0.transpose(-1, -2), []
        one, zero = q.new_ones(q.shape[0], q.shape[2]), q.new_zeros(q.shape[2])
        for t in range(q.shape[1]):
            y, state = mamba_state_step(v[:, t], one, zero, k[:, t], q[:, t] * q.shape[-1] ** -0.5, state)
            ys.append(y)
        return {"o": torch.stack(ys, 1), "state": state.transpose(-1, -2)}

    x = linear_inputs(T=45, K=16, V=8)
    out += compare_runs("cpu linear chunk vs ssd step", run_op(op_linear(False), x, cpu, f64), run_op(linear_as_ssd_step, x, cpu, f64))

    print(f"  {cpu_peak().describe()}")
    print(f"  CPU contention: {cpu_contention_warning() or f'none seen ({torch.get_num_threads()} torch threads)'}")
    print("  GPU peak table (dense TFLOP/s, datasheet; bf16 and tf32 on tensor cores, fp32 on CUDA cores):")
    for row in GPU_PEAKS:
        print(f"    {row.label:26s} bf16 {row.bf16 or '-':>7} tf32 {row.tf32 or '-':>7} fp32 {row.fp32:>6}   /{row.pattern}/")
    return out


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


def check_peak() -> list[str]:
    """The table's peak beside a measured matmul: a measurement above the datasheet means a wrong row."""
    name = torch.cuda.get_device_name()
    out = []
    for precision, dtype, n in (("bf16", torch.bfloat16, 8192), (cuda_fp32_precision(), torch.float32, 4096)):
        table = gpu_peak(name, precision)
        got = measured_matmul_tflops(dtype, n)
        ratio = f" = {got * 1e12 / table.flops:.0%} of the table" if table.flops else ""
        print(f"  {name} {precision}: measured {got:,.1f} TFLOP/s ({n}^3 matmul){ratio}; table: {table.describe()}")
        if table.flops and got * 1e12 > 1.05 * table.flops:
            out.append(f"MISMATCH peak {precision}: measured {got:.1f} TFLOP/s exceeds the table's {table.flops / 1e12:.1f} on {name!r}")
    return out


def check_kernels() -> list[str]:
    """Each fla fast path (CUDA, fp32) against our CPU path (float64), asserting the kernel ran."""
    try:
        import fla  # noqa: F401
    except ImportError as e:
        return [f"MISMATCH kernels: fla does not import ({e}); pip install -r requirements-gpu.txt"]
    cuda, cpu, f32, f64 = torch.device("cuda"), torch.device("cpu"), torch.float32, torch.float64
    gdn = ("q", "k", "v", "g", "beta", "initial_state")
    cases = [  # name, op, inputs, gradient inputs, fla module and function that must run
        ("gdn chunk T=300", op_gdn_chunk, gdn_inputs(300), gdn, "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
        ("gdn recurrent T=1", op_gdn_recurrent, gdn_inputs(1), (), "fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
        ("gdn recurrent T=7", op_gdn_recurrent, gdn_inputs(7), (), "fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
        ("linear chunk T=300", op_linear(False), linear_inputs(300), ("q", "k", "v", "S0"), "fla.ops.linear_attn", "chunk_linear_attn"),
        ("linear normalized chunk T=300", op_linear(True), linear_inputs(300), ("q", "k", "v", "S0", "z0"), "fla.ops.linear_attn", "chunk_linear_attn"),
        ("ssd chunk T=300", op_ssd, ssd_inputs(300), ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_states"),
         "fla.ops.simple_gla", "chunk_simple_gla"),
    ]
    out = []
    for name, op, inputs, grads, module, attr in cases:
        try:
            want = run_op(op, inputs, cpu, f64, grads)
            with counting(module, attr) as calls:
                got = run_op(op, inputs, cuda, f32, grads)
            torch.cuda.synchronize()
        except Exception as e:  # a kernel that raises is a finding, not the end of the check
            out.append(f"MISMATCH kernel {name}: raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        if calls[0] == 0:
            out.append(f"MISMATCH kernel {name}: {module}.{attr} did not run (the dispatch took the PyTorch path)")
        lines = compare_runs(f"kernel {name}", got, want)
        print(f"  {name}: {'ok' if not lines else f'{len(lines)} mismatch(es)'} ({calls[0]} fla call(s))")
        out += lines
    return out


def check_dsa(device: str = "cuda", T: int = 300, topk: int = 32) -> list[str]:
    """Mismatch messages (empty = all match) between the DSA ops on `device` and on the CPU for the
    same fp32 inputs: top-k selection (compared by selected score values: ties may pick other keys),
    both attention paths and the dispatch (outputs and q, k, v gradients), and the indexer scores at
    the selection (values and gradients); GQA with 1, 2 and 4 KV heads, T not a multiple of any block."""
    import model.ops.sparse_attention as sa

    H, D, H_I, D_I = 4, 64, 4, 32
    messages = []

    def compare(name, cpu, dev, tol=1e-4):
        for i, (a, b) in enumerate(zip(cpu, dev)):
            if not torch.allclose(a, b.cpu(), atol=tol, rtol=tol):
                messages.append(f"MISMATCH dsa {name} [{i}]: max |diff| {(a - b.cpu()).abs().max().item():.3g}")

    def run_op(op, inputs, on):
        xs = [t.detach().to(on).requires_grad_() for t in inputs]
        out = op(*xs)
        g = torch.Generator().manual_seed(1)
        (out * torch.randn(out.shape, generator=g).to(on).nan_to_num()).nan_to_num(posinf=0, neginf=0).sum().backward()
        return [out.detach().nan_to_num(posinf=0, neginf=0)] + [t.grad for t in xs]

    for kv in (1, 2, H):
        g = torch.Generator().manual_seed(kv)
        q, k, v = (torch.randn(2, T, n, D, generator=g) for n in (H, kv, kv))
        q_i, k_i, w = (torch.randn(2, T, *shape, generator=g) for shape in ((H_I, D_I), (D_I,), (H_I,)))
        idx = sa.index_topk(q_i, k_i, w, topk)
        idx_dev = sa.index_topk(q_i.to(device), k_i.to(device), w.to(device), topk).cpu()
        scores = sa.index_scores(q_i, k_i, w)
        picked = lambda i: scores.gather(-1, i.clamp(min=0)).masked_fill(i < 0, 0).sort(-1).values  # noqa: E731
        compare(f"index_topk, {kv} KV heads", [picked(idx)], [picked(idx_dev)])
        ops = {"sparse path": sa.sparse_attention, "masked path": sa.masked_attention,
               "selected_attention": lambda *a: sa.selected_attention(*a)[0]}
        for name, op in ops.items():
            compare(f"{name}, {kv} KV heads", run_op(lambda a, b, c: op(a, b, c, idx.to(a.device)), (q, k, v), "cpu"),
                    run_op(lambda a, b, c: op(a, b, c, idx.to(a.device)), (q, k, v), device))
        scores_at = lambda a, b, c: sa.index_scores_at(a, b, c, idx.to(a.device))  # noqa: E731
        compare(f"index_scores_at, {kv} KV heads", run_op(scores_at, (q_i, k_i, w), "cpu"),
                run_op(scores_at, (q_i, k_i, w), device))
    return messages


def small_model(mixer: str, vocab: int):
    """The mixer at its default options (those of configs/mixer/<mixer>.yaml)."""
    from model import DecoderLM, LMConfig

    torch.manual_seed(0)
    config = LMConfig(vocab_size=vocab, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      mixer=mixer, max_position_embeddings=1024)
    return DecoderLM(config).eval()


def check_model(mixers: list[str]) -> list[str]:
    """Per mixer on a 2-layer model: CUDA fp32 vs CPU fp32 loss and logits, bf16 autocast vs fp32 loss,
    greedy generate with the cache vs the full forward; torch.compile vs eager for COMPILE_MIXERS."""
    vocab, out = 512, []
    ids = torch.randint(0, vocab, (2, 200), generator=torch.Generator().manual_seed(0))  # 200: not a chunk multiple
    for mixer in mixers:
        t0 = time.perf_counter()
        lines = []
        try:
            model = small_model(mixer, vocab)
            with torch.no_grad():
                ref = model(ids, labels=ids)
                model.cuda()
                x = ids.cuda()
                fp32 = model(x, labels=x)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    bf16 = model(x, labels=x)
                lines.append(scalar_mismatch(f"model {mixer} cuda fp32 loss vs cpu", fp32.loss.item(), ref.loss.item(), 2e-3))
                lines.append(mismatch(f"model {mixer} cuda fp32 logits vs cpu", fp32.logits, ref.logits, 1e-2))
                lines.append(scalar_mismatch(f"model {mixer} bf16 autocast loss vs fp32", bf16.loss.item(), fp32.loss.item(), 1e-2))
                prompt = x[:1, :32]
                gen = model.generate(prompt, max_new_tokens=16, do_sample=False, use_cache=True, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=0)
                full = model(gen.sequences).logits[:, prompt.shape[1] - 1:-1]
                lines.append(mismatch(f"model {mixer} generate with cache vs full forward logits",
                                      torch.stack(gen.logits, 1), full, 1e-2))
                if mixer in COMPILE_MIXERS:
                    compiled = torch.compile(model)(x).logits
                    lines.append(mismatch(f"model {mixer} torch.compile logits vs eager", compiled, fp32.logits, 1e-3))
        except Exception as e:
            lines.append(f"MISMATCH model {mixer}: raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        lines = [line for line in lines if line]
        print(f"  {mixer}: {'ok' if not lines else f'{len(lines)} mismatch(es)'} ({time.perf_counter() - t0:.1f} s)")
        out += lines
    return out


def check_train(mixers: list[str], steps: int, timeout_s: float) -> list[str]:
    """train.py model=125m at T=2048 per mixer (bf16, batch 8 x 2048, logger off): tokens/s and MFU
    (median of the log windows after the first, which holds the kernels' compilation), peak memory."""
    out, rows = [], []
    log_every = max(steps // 6, 1)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for mixer in mixers:
            run_dir = Path(tmp) / mixer
            cmd = [sys.executable, str(ROOT / "train.py"), "model=125m", f"mixer={mixer}", "logger=none",
                   "trainer.seq_len=2048", "trainer.batch_size=8", f"trainer.max_steps={steps}",
                   f"trainer.warmup_steps={max(steps // 6, 1)}", f"trainer.log_every={log_every}",
                   f"trainer.eval_every={steps}", "trainer.eval_batches=1", f"trainer.ckpt_every={steps}",
                   "trainer.sample_tokens=0", f"run_dir={run_dir}"]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
            except subprocess.TimeoutExpired:
                out.append(f"MISMATCH train {mixer}: did not finish in {timeout_s:.0f} s")
                continue
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no output"]
                out.append(f"MISMATCH train {mixer}: train.py exited {proc.returncode}: {tail[0]}")
                continue
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            logged = [r for r in metrics if "perf/tokens_per_sec" in r]
            later = logged[1:] or logged
            median = lambda key: sorted(r[key] for r in later)[len(later) // 2] if key in later[0] else None  # noqa: E731
            first, last = logged[0]["train/loss"], logged[-1]["train/loss"]
            mfu = median("perf/mfu")
            rows.append((mixer, median("perf/tokens_per_sec"), mfu, max(r["perf/peak_mem_gb"] for r in logged), first, last, wall))
            if not last < first:
                out.append(f"MISMATCH train {mixer}: train loss did not fall ({first:.3f} -> {last:.3f} over {steps} steps)")
            if mfu is not None and mfu > 1:
                out.append(f"MISMATCH train {mixer}: MFU {mfu:.2f} > 1 (the FLOP count or the peak table is wrong)")
    if rows:
        print("  | mixer | tokens/s | MFU | peak mem GB | train loss (first -> last window) | wall s |")
        print("  |---|---|---|---|---|---|")
        for mixer, tok_s, mfu, mem, first, last, wall in rows:
            print(f"  | {mixer} | {tok_s:,.0f} | {'-' if mfu is None else f'{mfu:.1%}'} | {mem:.1f} | "
                  f"{first:.3f} -> {last:.3f} | {wall:.0f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-steps", type=int, default=30, help="steps per mixer of the 125m run (0: no training)")
    parser.add_argument("--train-mixers", nargs="+", default=MIXERS, choices=MIXERS, metavar="MIXER",
                        help=f"mixers to train (default: all of {', '.join(MIXERS)})")
    parser.add_argument("--train-timeout", type=float, default=150.0, help="seconds allowed per training run")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    print(f"torch {torch.__version__} | " + (f"CUDA {torch.version.cuda} on {torch.cuda.get_device_name()}" if cuda
                                              else "no CUDA device"))
    parts = [("cpu", check_cpu)]
    if cuda:
        parts += [("peak", check_peak), ("kernels", check_kernels), ("dsa", check_dsa),
                  ("model", lambda: check_model(MIXERS))]
        if args.train_steps:
            parts.append(("train", lambda: check_train(args.train_mixers, args.train_steps, args.train_timeout)))
    mismatches = []
    t_start = time.perf_counter()
    for name, check in parts:
        print(f"[{name}]")
        t0 = time.perf_counter()
        lines = check()
        print(f"[{name}] {'ok' if not lines else f'{len(lines)} mismatch(es)'} in {time.perf_counter() - t0:.1f} s")
        mismatches += lines
    if not cuda:
        print("CUDA is not available: ran the CPU checks only. The peak, kernels (fla), model (bf16 autocast, "
              "torch.compile, generate with the cache) and 125m training checks need a CUDA GPU with "
              "requirements-gpu.txt installed.")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    for line in mismatches:
        print(line)
    print(f"{len(mismatches)} mismatch(es)" if mismatches else "all checks passed")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
