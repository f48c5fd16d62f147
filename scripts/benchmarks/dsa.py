"""DSA attention core speed and activation memory beside dense causal SDPA of the same shape.

The DSA core is what the `dsa` mixer runs between its projections in the sparse stage: lightning
indexer scores + top-k selection (no grad), attention over the selected keys (gather path, fwd+bwd),
and the indexer KL over the selected keys (fwd+bwd). Dense is F.scaled_dot_product_attention (causal).
Both take the same q, k, v [B, T, H, D]; the indexer gets H_I heads of d_I. Activation memory is
autograd's saved tensors (scripts/benchmarks/common.saved_activation_bytes), inputs included once.

Peer from transformers: DeepSeek-V3.2's `DeepseekV32Indexer` (its own projections from a hidden state
of width 256; inference-only, no grad) followed by SDPA under the [T, S] top-k mask it feeds its
eager/sdpa attention, forward only: the masked path, whose cost stays O(T^2).
Timings are wall-clock, interleaved rounds, median of medians. On a CPU shared with other jobs, run with
OMP_NUM_THREADS=1: oversubscribed multi-threaded gathers and scatters slow down erratically (10x+).
"""
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DeepseekV32Config
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

from model.layers import RotaryEmbedding
from model.mixers.dsa import indexer_kl
from model.mixers.softmax import attend
from model.ops.sparse_attention import (index_scores_at, index_topk, selected_attention_probs,
                                        sparse_attention)
from scripts.benchmarks.common import markdown_table, saved_activation_bytes, time_call

ROOT = Path(__file__).resolve().parents[2]
B, H, D, H_I, D_I, TOPK = 1, 4, 64, 4, 32, 256


def make_inputs(T: int, kv_heads: int = H, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).requires_grad_()  # noqa: E731
    return dict(q=r(B, T, H, D), k=r(B, T, kv_heads, D), v=r(B, T, kv_heads, D), q_i=r(B, T, H_I, D_I, scale=D_I**-0.5),
                k_i=r(B, T, D_I), w=r(B, T, H_I, scale=H_I**-0.5), grad=torch.randn(B, T, H, D, generator=g))


def dense_loss(x: dict) -> torch.Tensor:
    o = attend(x["q"].transpose(1, 2), x["k"].transpose(1, 2), x["v"].transpose(1, 2)).transpose(1, 2)
    return (o * x["grad"]).sum()


def selection(x: dict) -> torch.Tensor:
    return index_topk(x["q_i"], x["k_i"], x["w"], TOPK)


def attention_loss(x: dict, idx: torch.Tensor) -> torch.Tensor:
    return (sparse_attention(x["q"], x["k"], x["v"], idx) * x["grad"]).sum()


def kl_loss(x: dict, idx: torch.Tensor) -> torch.Tensor:
    return indexer_kl(selected_attention_probs(x["q"], x["k"], idx), index_scores_at(x["q_i"], x["k_i"], x["w"], idx))


def dsa_loss(x: dict) -> torch.Tensor:
    idx = selection(x)
    return attention_loss(x, idx) + kl_loss(x, idx)


def fwd_bwd(loss_fn):
    return lambda: loss_fn().backward()


def forward_only(fn):
    def step():
        with torch.no_grad():
            fn()
    return step


def hf_masked_peer(T: int):
    """transformers' DSA forward: DeepseekV32Indexer top-k -> boolean mask -> SDPA (dense cost)."""
    d = 256
    cfg = DeepseekV32Config(hidden_size=d, q_lora_rank=d, index_n_heads=H_I, index_head_dim=D_I,
                            qk_rope_head_dim=D_I // 2, index_topk=TOPK)
    indexer = DeepseekV32Indexer(cfg, 0)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, d, generator=g)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    cos, sin = RotaryEmbedding(D_I // 2).cos_sin(0, T, "cpu")
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]

    def step():
        with torch.no_grad():
            idx = indexer(hidden, hidden, (cos[None], sin[None]), causal, None)
            selected = torch.zeros(B, T, T, dtype=torch.bool).scatter(-1, idx.long(), True)
            F.scaled_dot_product_attention(q, k, v, attn_mask=(selected & causal)[:, None])
    return step


def measure(cases: dict, rounds: int, iters: int) -> dict:
    times = {name: [] for name in cases}
    for _ in range(rounds):  # interleaved, so load from other processes hits all alike
        for name, fn in cases.items():
            times[name].append(time_call(fn, warmup=1, iters=iters))
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def run(quick: bool) -> str:
    torch.manual_seed(0)
    T_head = 2048 if quick else 4096
    lengths = [512, 1024, 2048] if quick else [1024, 2048, 4096, 8192]
    rounds, iters = (1, 1) if quick else (2, 1)

    # ---- headline shape: components, peer, memory ----
    x, mqa = make_inputs(T_head), make_inputs(T_head, kv_heads=1)
    idx = selection(x)
    full = "DSA core fwd+bwd (index + top-k + sparse attn + indexer KL)"
    cases = {
        "dense SDPA fwd+bwd": fwd_bwd(lambda: dense_loss(x)),
        full: fwd_bwd(lambda: dsa_loss(x)),
        "  index + top-k (no grad)": forward_only(lambda: selection(x)),
        "  sparse attention fwd+bwd (given indices)": fwd_bwd(lambda: attention_loss(x, idx)),
        "  indexer KL fwd+bwd (given indices)": fwd_bwd(lambda: kl_loss(x, idx)),
        "dense SDPA fwd": forward_only(lambda: dense_loss(x)),
        "DSA core fwd": forward_only(lambda: dsa_loss(x)),
        "transformers DeepseekV32Indexer + top-k-masked SDPA fwd": hf_masked_peer(T_head),
        "dense SDPA fwd+bwd, 1 KV head (MQA)": fwd_bwd(lambda: dense_loss(mqa)),
        "DSA core fwd+bwd, 1 KV head (MQA, as DeepSeek's MLA)": fwd_bwd(lambda: dsa_loss(mqa)),
    }
    t = measure(cases, rounds, iters)
    mem = {"dense SDPA fwd+bwd": saved_activation_bytes(lambda: dense_loss(x)),
           full: saved_activation_bytes(lambda: dsa_loss(x)),
           "dense SDPA fwd+bwd, 1 KV head (MQA)": saved_activation_bytes(lambda: dense_loss(mqa)),
           "DSA core fwd+bwd, 1 KV head (MQA, as DeepSeek's MLA)": saved_activation_bytes(lambda: dsa_loss(mqa))}
    base = t["dense SDPA fwd+bwd"]
    rows = [[name, f"{1e3 * s:.1f}", f"{base / s:.2f}x", f"{mem[name] / 2**20:.1f}" if name in mem else ""]
            for name, s in t.items()]
    report = [f"B={B}, T={T_head}, H={H} (KV heads {H}), D={D}, indexer {H_I} heads x {D_I}, top-k {TOPK}; "
              f"fp32 CPU, {torch.get_num_threads()} threads. Speed-up is against dense SDPA fwd+bwd.", "",
              markdown_table(["case", "ms", "speed-up vs dense fwd+bwd", "saved activations MiB"], rows)]

    # ---- scaling ----
    rows, curves = [], {"dense SDPA": [], "DSA core": []}
    for T in lengths:
        x = make_inputs(T)
        ts = measure({"dense SDPA": fwd_bwd(lambda: dense_loss(x)), "DSA core": fwd_bwd(lambda: dsa_loss(x))},
                     rounds, iters)
        md = saved_activation_bytes(lambda: dense_loss(x)) / 2**20
        ms = saved_activation_bytes(lambda: dsa_loss(x)) / 2**20
        curves["dense SDPA"].append(ts["dense SDPA"])
        curves["DSA core"].append(ts["DSA core"])
        rows.append([T, f"{1e3 * ts['dense SDPA']:.1f}", f"{1e3 * ts['DSA core']:.1f}",
                     f"{ts['dense SDPA'] / ts['DSA core']:.2f}x", f"{md:.1f}", f"{ms:.1f}"])
    report += ["", f"Scaling, fwd+bwd (top-k {TOPK}):", "",
               markdown_table(["T", "dense SDPA ms", "DSA core ms", "DSA speed-up", "dense MiB", "DSA MiB"], rows)]
    report += ["", f"Plot: {plot(lengths, curves)}"]
    return "\n".join(report)


def plot(lengths: list[int], curves: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = ROOT / "outputs" / "bench" / "dsa_scaling.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, ys in curves.items():
        ax.plot(lengths, [1e3 * y for y in ys], marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="fwd+bwd ms",
           title=f"attention core, B={B} H={H} D={D}, top-k {TOPK}")
    ax.minorticks_off()
    ax.set_xticks(lengths, [str(t) for t in lengths])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path.relative_to(ROOT))
