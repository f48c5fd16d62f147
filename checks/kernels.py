"""Stage kernels' checks of the fast paths training uses: our CPU paths against each other, the peak table against a
measured matmul, every fla kernel, MoE's grouped matmul and the DSA ops on CUDA against our CPU path."""
import math

import torch

from checks.fla_cases import (CU_SEQLENS, compare_runs, gdn_inputs, linear_inputs, op_gdn_chunk, op_gdn_recurrent,
                              op_linear, op_product_chunk, op_product_recurrent, op_ssd, packed, product_inputs, rounded,
                              run_op, ssd_inputs)
from checks.stage import BF16_FWD_TOL, BF16_GRAD_TOL, Stage, counting, mismatch, training_model_config
from training.perf import GPU_PEAKS, cpu_contention_warning, cpu_peak, cuda_fp32_precision, gpu_peak


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


def kernel_shapes() -> dict:
    """The fla calls' head counts and widths in a model=125m layer of each mixer that has them."""
    from model import MIXERS

    with torch.device("meta"):
        gdn, deltanet, kda, gdn2, product, derived, linear, mamba2 = (MIXERS.get(m)(training_model_config(m), 0) for m in (
            "gdn", "deltanet", "kda", "gdn2", "deltaproduct", "derived_gdn", "linear", "mamba2"))
    return {**{name: dict(H=m.num_v_heads, K=m.head_dim, V=m.head_v_dim)  # q, k repeated to the value heads
               for name, m in (("gdn", gdn), ("deltanet", deltanet), ("kda", kda), ("gdn2", gdn2))},
            "deltaproduct": dict(H=product.num_v_heads, K=product.head_dim, V=product.head_v_dim, steps=product.steps),
            "derived_gdn": dict(H=derived.num_heads, K=derived.head_dim, V=derived.head_dim),
            "linear": dict(H=linear.num_heads, K=linear.head_dim, V=linear.head_dim),
            "mamba2": dict(H=mamba2.num_heads, P=mamba2.head_dim, G=mamba2.n_groups, N=mamba2.state_size)}


def kernel_cases() -> list[tuple]:
    """(name, op, inputs, gradient inputs, fla module, fla function, bf16?) for every case of check_fla:
    each kernel packed (cu_seqlens, B = 1) and with initial states (B = 2, T = 300), fp32 and bf16."""
    shapes = kernel_shapes()
    T = CU_SEQLENS[-1]
    GDN, LIN, SSD = "fla.ops.gated_delta_rule", "fla.ops.linear_attn", "fla.ops.simple_gla"
    DELTA, KDA, GDN2 = "fla.ops.delta_rule", "fla.ops.kda", "fla.ops.gdn2"
    gdn_grads, lin_grads = ("q", "k", "v", "g", "beta"), ("q", "k", "v")
    gdn2 = dict(decay="per_channel", gates="channel", **shapes["gdn2"])  # GDN-2: erase and write gates per channel
    delta_grads = ("q", "k", "v", "beta")
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
            (f"deltanet chunk packed {p}", op_gdn_chunk,
             packed(gdn_inputs(T, B=1, state=False, decay="none", max_beta=2.0, **shapes["deltanet"])), delta_grads,
             GDN, "chunk_gated_delta_rule", bf16),  # with g = 0: fla's chunk_delta_rule refuses fp32
            (f"deltanet recurrent one step {p}", op_gdn_recurrent, gdn_inputs(1, decay="none", **shapes["deltanet"]), (),
             DELTA, "fused_recurrent_delta_rule", bf16),
            (f"kda chunk packed {p}", op_gdn_chunk,
             packed(gdn_inputs(T, B=1, state=False, decay="per_channel", max_beta=2.0, **shapes["kda"])), gdn_grads,
             KDA, "chunk_kda", bf16),
            (f"kda recurrent one step {p}", op_gdn_recurrent, gdn_inputs(1, decay="per_channel", **shapes["kda"]), (),
             KDA, "fused_recurrent_kda", bf16),
            (f"gdn2 chunk packed {p}", op_gdn_chunk, packed(gdn_inputs(T, B=1, state=False, max_beta=2.0, **gdn2)),
             gdn_grads + ("write",), GDN2, "chunk_gdn2", bf16),
            (f"gdn2 recurrent one step {p}", op_gdn_recurrent, gdn_inputs(1, **gdn2), (), GDN2, "fused_recurrent_gdn2", bf16),
            # Gated DeltaProduct: fla's GDN kernels on the interleaved Householder steps (model/ops/gated_delta/product.py)
            (f"deltaproduct chunk packed {p}", op_product_chunk,
             packed(product_inputs(T, B=1, state=False, **shapes["deltaproduct"])), gdn_grads, GDN, "chunk_gated_delta_rule",
             bf16),
            (f"deltaproduct recurrent one step {p}", op_product_recurrent, product_inputs(1, **shapes["deltaproduct"]), (),
             GDN, "fused_recurrent_gated_delta_rule", bf16),
            (f"linear packed {p}", op_linear(True), packed(linear_inputs(T, B=1, state=False, **shapes["linear"])), lin_grads,
             LIN, "chunk_linear_attn", bf16),
            (f"linear initial state {p}", op_linear(True), linear_inputs(300, **shapes["linear"]), lin_grads + ("S0", "z0"),
             LIN, "chunk_linear_attn", bf16),
            (f"mamba2 ssd packed {p}", op_ssd, packed(ssd_inputs(T, B=1, state=False, **shapes["mamba2"])), ssd_grads,
             SSD, "chunk_simple_gla", bf16),
            (f"mamba2 ssd initial state {p}", op_ssd, ssd_inputs(300, **shapes["mamba2"]), ssd_grads + ("initial_states",),
             SSD, "chunk_simple_gla", bf16),
            (f"mamba2 ssd negative eigenvalues initial state {p}", op_ssd,
             ssd_inputs(300, allow_neg_eigval=True, **shapes["mamba2"]), ssd_grads + ("initial_states",),
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
    from model.ffn.experts import ExpertsLoop, experts_grouped_mm

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
    import model.ops.sparse_attention.lightning_indexer as li

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
            idx = li.index_topk(q_i, k_i, w, topk, segment_ids=segment_ids)
            idx_dev = li.index_topk(q_i.to(device), k_i.to(device), w.to(device), topk,
                                    segment_ids=segment_ids.to(device)).cpu()
            scores = li.index_scores(q_i, k_i, w, segment_ids=segment_ids)
            picked = lambda i: scores.gather(-1, i.clamp(min=0)).masked_fill(i < 0, 0).sort(-1).values  # noqa: E731
            out = compare(f"index_topk, {kv} KV heads", [picked(idx)], [picked(idx_dev)])
            ops = {"sparse path": lambda a, b, c: sa.sparse_attention(a, b, c, csr(idx, T, a.device)),
                   "masked path": lambda a, b, c: sa.masked_attention(a, b, c, idx.to(a.device)),
                   "selected_attention": lambda a, b, c: sa.selected_attention(a, b, c, csr(idx, T, a.device))[0]}
            for name, op in ops.items():
                out += compare(f"{name}, {kv} KV heads", run_op(op, (q, k, v), "cpu"), run_op(op, (q, k, v), device))
            scores_at = lambda a, b, c: li.index_scores_at(a, b, c, csr(idx, T, a.device))  # noqa: E731
            return out + compare(f"index_scores_at, {kv} KV heads", run_op(scores_at, (q_i, k_i, w), "cpu"),
                                 run_op(scores_at, (q_i, k_i, w), device))
        stage.case(f"{kv} KV heads", case)
