"""Gated DeltaNet speed beside transformers' Qwen3-Next torch path (flash-linear-attention is not
installed here; the peer's op is called through `__wrapped__`, its torch function, and the model's
module-level op is swapped for a counting wrapper around that same function, so the peer surely runs
its PyTorch code).

Op: fwd+bwd of model.ops.gated_delta.chunk_gated_delta_rule vs transformers' torch_chunk_gated_delta_rule
on the same inputs (L2-normed q, k), outputs checked to agree: ours at its default chunk 32 (the fastest
on CPU), transformers at its default 64 (what Qwen3-Next runs) and at 32. GFLOP/s counts our op's
nominal FLOPs (model.ops.gated_delta.chunk_gated_delta_flops at chunk 32, 3x forward) for every row.

Model: fwd+bwd+AdamW tokens/s, batch 8 x 256, vocab 512, d 256, 4 layers, 4 q/k heads of 64, 4 value
heads of 128 (expand_v 2), conv 4, SwiGLU FFN 704, tied embeddings:
  - ours: DecoderLM mixer=gdn (chunk 32, the gdn default);
  - transformers Qwen3NextForCausalLM, every layer linear_attention, dense MLP (num_experts 0).
Timings are interleaved rounds, median; GFLOP/s against the fp32 matmul peak of the same run. A second
speed column is CPU time on one thread (time.thread_time, best of interleaved rounds), which other
processes' load barely moves.
"""
import time

import torch
import torch.nn.functional as F
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next

from model import DecoderLM, LMConfig
from model.ops.gated_delta import chunk_gated_delta_flops, chunk_gated_delta_rule
from scripts.benchmarks.common import interleaved, markdown_table, matmul_peak_gflops

VOCAB, D, LAYERS, HEADS, HEAD_DIM, EXPAND_V = 512, 256, 4, 4, 64, 2
OUR_CHUNK, HF_CHUNKS = 32, (64, 32)  # ours: its default (fastest on CPU); transformers': its default, then ours
HF_CHUNK = getattr(hf_qwen3_next.torch_chunk_gated_delta_rule, "__wrapped__",
                   hf_qwen3_next.torch_chunk_gated_delta_rule)


def cpu_interleaved(fns: dict, rounds: int) -> dict:
    """Best over rounds of each fn's one-thread CPU seconds (after one warm-up call), in turns."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for fn in fns.values():
            fn()
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.thread_time()
                fn()
                times[name].append(time.thread_time() - t0)
    finally:
        torch.set_num_threads(threads)
    return {name: min(t) for name, t in times.items()}


def op_report(shapes: list[tuple], rounds: int, iters: int, peak: float) -> str:
    rows = []
    for Bsz, T, H, K in shapes:
        g = torch.Generator().manual_seed(0)
        q, k = (F.normalize(torch.randn(Bsz, T, H, K, generator=g), dim=-1) for _ in range(2))
        v = torch.randn(Bsz, T, H, K, generator=g)
        gate = F.logsigmoid(torch.randn(Bsz, T, H, generator=g) + 2)
        beta = torch.rand(Bsz, T, H, generator=g)
        args = [x.requires_grad_() for x in (q, k, v, gate, beta)]
        fns = {f"ours, chunk {OUR_CHUNK}": lambda: chunk_gated_delta_rule(*args, chunk_size=OUR_CHUNK)[0],
               **{f"transformers, chunk {c}": (lambda c=c: HF_CHUNK(*args, chunk_size=c)[0]) for c in HF_CHUNKS}}
        peer = f"transformers, chunk {HF_CHUNKS[0]}"
        with torch.no_grad():
            ref = fns[peer]()
            err = max((fn() - ref).abs().max().item() for fn in fns.values())
        steps = {name: (lambda fn=fn: fn().sum().backward()) for name, fn in fns.items()}
        timed = interleaved(steps, rounds, iters)
        cpu = cpu_interleaved(steps, rounds)
        flops = 3 * H * chunk_gated_delta_flops(K, K, T, OUR_CHUNK) * Bsz * T
        for name, t in timed.items():
            rows.append([f"B {Bsz} x T {T}, H {H}, K=V {K}", name, f"{t * 1e3:.1f}", f"{flops / t / 1e9:.1f}",
                         f"{flops / t / 1e9 / peak:.1%}", f"{timed[peer] / t:.2f}x",
                         f"{timed[f'transformers, chunk {HF_CHUNKS[1]}'] / t:.2f}x",
                         f"{cpu[name] * 1e3:.1f}", f"{cpu[peer] / cpu[name]:.2f}x", f"{err:.1e}"])
    return (f"Op chunk_gated_delta_rule, fwd+bwd; transformers at chunk {HF_CHUNKS[0]} (its default, what Qwen3-Next "
            f"runs) and {HF_CHUNKS[1]}; GFLOP/s from our op's FLOPs at chunk {OUR_CHUNK} for every row; the last column "
            "is the largest |o| difference from transformers at its default:\n\n"
            + markdown_table(["shape", "op", "ms", "GFLOP/s", "of peak", f"speed vs tf chunk {HF_CHUNKS[0]}",
                              f"speed vs tf chunk {HF_CHUNKS[1]}", "1-thread CPU ms",
                              f"speed vs tf chunk {HF_CHUNKS[0]} (1-thread CPU)", "max |o - o_tf|"], rows))


def model_report(Bsz: int, T: int, rounds: int, iters: int, peak: float) -> str:
    torch.manual_seed(0)
    config = LMConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      mixer="gdn", max_position_embeddings=max(2048, T),
                      mixer_options={"gdn": dict(head_dim=HEAD_DIM, expand_v=EXPAND_V, conv_size=4, chunk_size=OUR_CHUNK)})
    ours = DecoderLM(config)
    hf_config = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=config.intermediate_size, num_hidden_layers=LAYERS,
        layer_types=["linear_attention"] * LAYERS, linear_conv_kernel_dim=4, linear_key_head_dim=HEAD_DIM,
        linear_value_head_dim=HEAD_DIM * EXPAND_V, linear_num_key_heads=HEADS, linear_num_value_heads=HEADS,
        num_experts=0, tie_word_embeddings=True, rms_norm_eps=config.rms_norm_eps, use_cache=False)
    hf = Qwen3NextForCausalLM(hf_config)
    calls = {"n": 0}

    def counting_torch_chunk(*args, **kwargs):
        calls["n"] += 1
        return HF_CHUNK(*args, **kwargs)

    hf_qwen3_next.torch_chunk_gated_delta_rule = counting_torch_chunk
    ids = torch.randint(0, VOCAB, (Bsz, T), generator=torch.Generator().manual_seed(1))

    def train_step(model):
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            loss = model(ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return step

    models = {"ours, DecoderLM mixer=gdn": ours, "transformers Qwen3NextForCausalLM, all linear_attention": hf}
    try:
        steps = {name: train_step(m) for name, m in models.items()}
        timed = interleaved(steps, rounds, iters)
        cpu = cpu_interleaved(steps, rounds)
    finally:
        hf_qwen3_next.torch_chunk_gated_delta_rule = HF_CHUNK
    if calls["n"] == 0:
        raise RuntimeError("Qwen3-Next did not run transformers' torch_chunk_gated_delta_rule")
    fpt = ours.flops_per_token(T, "cpu")  # same shapes for both models
    peer = timed["transformers Qwen3NextForCausalLM, all linear_attention"]
    rows = []
    for name, m in models.items():
        t = timed[name]
        gflops = 3 * fpt * Bsz * T / t / 1e9
        rows.append([name, f"{sum(p.numel() for p in m.parameters()) / 1e6:.3f}M", f"{Bsz * T / t:,.0f}",
                     f"{peer / t:.2f}x", f"{fpt / 1e6:.2f}", f"{gflops:.1f}", f"{gflops / peak:.1%}",
                     f"{Bsz * T / cpu[name]:,.0f}", f"{cpu[next(reversed(models))] / cpu[name]:.2f}x"])
    return (f"Model, fwd+bwd+AdamW, batch {Bsz} x {T}, vocab {VOCAB}, d {D}, {LAYERS} layers, {HEADS} heads, "
            f"d_k {HEAD_DIM}, d_v {HEAD_DIM * EXPAND_V}, SwiGLU {config.intermediate_size} (Qwen3-Next torch op "
            f"calls counted: {calls['n']}):\n\n"
            + markdown_table(["model", "params", "tokens/s", "speed vs transformers", "fwd MFLOP/token",
                              "GFLOP/s", "of peak", "1-thread CPU tokens/s", "speed (1-thread CPU)"], rows))


def run(quick: bool) -> str:
    shapes = [(2, 128, 4, 64)] if quick else [(8, 256, 4, 64), (1, 2048, 4, 64)]
    Bsz, T = (2, 128) if quick else (8, 256)
    rounds, iters = (2, 2) if quick else (5, 3)
    peak = matmul_peak_gflops()
    return "\n\n".join([
        f"torch threads {torch.get_num_threads()}; fp32 matmul peak {peak:.0f} GFLOP/s (same run).",
        op_report(shapes, rounds, iters, peak),
        model_report(Bsz, T, rounds, iters, peak),
    ])
