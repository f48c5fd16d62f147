"""MoE layer speed: our `moe` FFN beside transformers' Qwen2-MoE sparse block of the same shape.

Both run router + top-k + routed SwiGLU experts (no shared expert) on the same weights, checked to
agree. transformers is measured twice: its experts module standalone (`eager`: a loop over hit
experts, the default when the block is built outside a PreTrainedModel) and with
`grouped_mm` (what a PreTrainedModel selects by default; torch's CPU grouped-mm kernel here).
Each case is timed in interleaved rounds (median of a few calls per round) and the best round is
kept, so load from other processes hits all cases alike and is partly filtered out. GFLOP/s counts
active forward+backward FLOPs (3x forward: router + k experts per token); compare it with the fp32
matmul peak measured in the same run. A second table gives fwd+bwd CPU time on one thread
(time.process_time), which other processes on the machine barely disturb.

A third table times each router (ffn.options.router, model/ffn/routers) at the default recipe's
shape (model=tiny: d 256, E 8, k 2, expert width 384; one micro-batch of 8 x 256 tokens), in
training mode with its aux losses and telemetry, fwd+bwd as a ratio to top-k's in the same run
(interleaved rounds; the median round): on CUDA when there is one, under bf16 autocast as training
runs there; on CPU in fp32, with the 1-thread CPU time beside the wall time.
"""
import warnings

import torch
from transformers import Qwen2MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from model.config import LMConfig
from model.ffn.moe import MoE
from model.layers import AuxCollector
from scripts.benchmarks.common import cpu_times, interleaved, markdown_table, matmul_peak_gflops, time_call


FWD_BWD = ("ours", "ours + aux losses/metrics", "transformers eager", "transformers grouped_mm")


def cpu_time(fn, iters: int) -> float:
    """Median CPU seconds (process time) of fn() over `iters` calls after one warm-up call."""
    times = sorted(cpu_times(fn, iters))
    return times[len(times) // 2]


def build(E: int, k: int, d: int, f: int):
    ours = MoE(LMConfig(hidden_size=d, num_hidden_layers=1, ffn="moe", ffn_options={"moe": dict(
        num_experts=E, top_k=k, expert_intermediate_size=f, router_options=dict(norm_topk_prob=False))}))
    ours.router.init_parameters()
    ours.init_parameters()
    theirs = {}
    for impl in ("eager", "grouped_mm"):
        cfg = Qwen2MoeConfig(hidden_size=d, moe_intermediate_size=f, num_experts=E, num_experts_per_tok=k,
                             shared_expert_intermediate_size=0, norm_topk_prob=False)
        cfg._experts_implementation = impl
        with warnings.catch_warnings():  # the zero-width shared expert warns at init
            warnings.simplefilter("ignore")
            block = Qwen2MoeSparseMoeBlock(cfg)
        with torch.no_grad():  # same weights: theirs are stored [E, out, in]
            block.gate.weight.copy_(ours.router.weight)
            block.experts.gate_up_proj.copy_(ours.gate_up_proj.transpose(1, 2))
            block.experts.down_proj.copy_(ours.down_proj.transpose(1, 2))
        theirs[impl] = block
    return ours, theirs


# Each router at the default MoE options; top-k also group-limited (4 groups of 2 experts, at most 2 per token).
ROUTER_CASES = {"topk": {}, "expert_choice": {"router": "expert_choice"}, "hash": {"router": "hash"},
                "balanced": {"router": "balanced"}, "reinforce": {"router": "reinforce"},
                "topk, group-limited": {"num_expert_groups": 4, "router_options": {"max_groups_per_token": 2}}}


def routers(quick: bool) -> str:
    """fwd+bwd of the MoE layer with each router, as a ratio to top-k's, same weights and input."""
    d, f, rows, T = 256, 384, (2 if quick else 8), 256  # configs/model/tiny.yaml, MoEOptions defaults, train.yaml
    rounds, iters = (2, 2) if quick else (5, 3)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    x = torch.randn(rows, T, d, device=device, requires_grad=True)
    grad = torch.randn(rows, T, d, device=device)
    ids = torch.randint(0, 4096, (rows, T), device=device)
    layers = {}
    for name, options in ROUTER_CASES.items():
        m = MoE(LMConfig(hidden_size=d, num_hidden_layers=4, intermediate_size=768, ffn="moe",
                         ffn_options={"moe": options}))
        torch.manual_seed(1)  # same weights for every router
        m.router.init_parameters()
        m.init_parameters()
        layers[name] = m.to(device).train()

    def fwd_bwd(module):
        def step():
            aux = AuxCollector()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                y = module(x, aux, ids)
            loss = (y.float() * grad).sum()
            # router=reinforce: a loss per token (its term of the loss here), as DecoderLM hands over the CE
            aux.give_token_loss(lambda: (y.float() * grad).sum(-1).flatten(),
                                torch.ones(y.shape[0] * y.shape[1], dtype=torch.bool, device=device))
            if (extra := aux.total_loss()) is not None:
                loss = loss + extra
            loss.backward()
        return step

    steps = {name: fwd_bwd(m) for name, m in layers.items()}
    wall = interleaved(steps, rounds, iters)
    header, table = ["router", "fwd+bwd ms", "x top-k"], [[name, wall[name] * 1e3, wall[name] / wall["topk"]] for name in layers]
    if device.type == "cpu":  # CPU time on one thread: barely disturbed by other processes
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        cpu = {name: [] for name in steps}
        for _ in range(rounds):
            for name, step in steps.items():
                cpu[name].append(cpu_time(step, iters))
        cpu = {name: sorted(ts)[len(ts) // 2] for name, ts in cpu.items()}
        torch.set_num_threads(threads)
        header += ["CPU ms, 1 thread", "x top-k"]
        for row in table:
            row += [cpu[row[0]] * 1e3, cpu[row[0]] / cpu["topk"]]
    where = (f"CUDA ({torch.cuda.get_device_name()}), bf16 autocast" if device.type == "cuda"
             else f"CPU, fp32, {torch.get_num_threads()} threads")
    note = (f"{rows * T} tokens ({rows} x {T}), d={d}, E=8, k=2, expert width {f}, training mode with aux losses and "
            f"telemetry; {where}; median of {rounds} interleaved rounds of the median of {iters} calls.")
    return note + "\n\n" + markdown_table(header, table)


def run(quick: bool) -> str:
    return transformers_comparison(quick) + "\n\n### Routers\n\n" + routers(quick)


def transformers_comparison(quick: bool) -> str:
    d = f = 256
    N = 512 if quick else 2048
    rounds, iters = (2, 2) if quick else (3, 3)
    peak = matmul_peak_gflops()  # measured again at the end; the best is reported
    results, cpu_rows = [], []
    for E, k in [(8, 2), (32, 4)]:
        torch.manual_seed(0)
        ours, theirs = build(E, k, d, f)
        x = torch.randn(1, N, d, requires_grad=True)
        grad = torch.randn(1, N, d)
        with torch.no_grad():  # same function, so the timings compare like with like
            ref = theirs["eager"](x)
            for y in (ours(x), theirs["grouped_mm"](x)):
                torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)

        def fwd_bwd(module, with_aux=False):
            def step():
                y = module(x, AuxCollector()) if with_aux else module(x)
                y.backward(grad)
            return step

        def fwd(module):
            def step():
                with torch.no_grad():
                    module(x)
            return step

        cases = {
            "ours": fwd_bwd(ours),
            "ours + aux losses/metrics": fwd_bwd(ours, with_aux=True),
            "transformers eager": fwd_bwd(theirs["eager"]),
            "transformers grouped_mm": fwd_bwd(theirs["grouped_mm"]),
            "ours fwd": fwd(ours),
            "transformers eager fwd": fwd(theirs["eager"]),
            "transformers grouped_mm fwd": fwd(theirs["grouped_mm"]),
        }
        times = {name: [] for name in cases}
        ours.train()
        for _ in range(rounds):
            for name, fn in cases.items():
                times[name].append(time_call(fn, warmup=1, iters=iters))
        best = {name: min(ts) for name, ts in times.items()}
        flops = 3 * N * ours.flops_per_token()
        results.append((E, k, best, flops))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        cpu = {name: [] for name in FWD_BWD}
        for _ in range(rounds):
            for name in FWD_BWD:
                cpu[name].append(cpu_time(cases[name], iters))
        cpu = {name: min(ts) for name, ts in cpu.items()}
        torch.set_num_threads(threads)
        cpu_rows.append([f"E={E},k={k}", *(cpu[name] * 1e3 for name in FWD_BWD),
                         cpu["transformers eager"] / cpu["ours"], cpu["transformers grouped_mm"] / cpu["ours"]])
    peak = max(peak, matmul_peak_gflops())
    rows = []
    for E, k, best, flops in results:
        for name in FWD_BWD:
            rows.append([f"E={E},k={k}", name, best[name] * 1e3, N / best[name],
                         best["transformers eager"] / best[name], best["transformers grouped_mm"] / best[name],
                         flops / best[name] / 1e9, flops / best[name] / 1e9 / peak,
                         best[name + " fwd"] * 1e3 if name + " fwd" in best else ""])
    header = ["shape", "impl", "fwd+bwd ms", "tokens/s", "speed-up vs eager", "speed-up vs grouped_mm",
              "GFLOP/s (active)", "of matmul peak", "fwd-only ms"]
    note = (f"{N} tokens, d={d}, expert width {f}, fp32, {torch.get_num_threads()} threads; "
            f"fp32 matmul peak measured in this run: {peak:.0f} GFLOP/s.")
    cpu_header = ["shape", *(f"{name} CPU ms" for name in FWD_BWD), "speed-up vs eager", "speed-up vs grouped_mm"]
    return (note + "\n\n" + markdown_table(header, rows) + "\n\nfwd+bwd CPU time, 1 thread (best of "
            f"{rounds} rounds of median of {iters}):\n\n" + markdown_table(cpu_header, cpu_rows))

