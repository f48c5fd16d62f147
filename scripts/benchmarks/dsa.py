"""DSA speed beside dense causal SDPA and transformers' masked DSA, as ratios of 1-thread process CPU
time (time.process_time under torch.set_num_threads(1)): cases take turns within each round, so load
from other processes on a shared CPU hits all alike; medians over rounds.

The DSA core is what the `dsa` mixer runs between its projections in the sparse stage: lightning
indexer scores + top-k selection (no grad), attention over the selected keys by the path
`attention_path` picks (the sparse SDDMM/SpMM path or the masked fused-SDPA path), and the indexer
KL over the selected keys (fwd+bwd). Dense is F.scaled_dot_product_attention (causal). All take the
same q, k, v [B, T, H, D]; the indexer gets H_I heads of d_I.

Peer from transformers: DeepSeek-V3.2's `DeepseekV32Indexer` (its own projections from a hidden state
of width 256; no grad, it has no indexer loss) followed by SDPA under the [T, T] top-k mask it feeds
its eager/sdpa attention, forward and forward+backward: the masked path whose cost stays O(T^2).
Its work matches "DSA index + top-k + attention"; our full core also trains the indexer (KL).

Model level: a 1-layer DecoderLM (d 256, 4 heads of 64, SwiGLU 768, vocab 512) with mixer=dsa
(top-k 256) vs mixer=softmax, fwd + bwd + AdamW at B 1, for 1 and for 4 KV heads; then, at the longest
T with 1 KV head, both model steps beside the attention parts at the model's shapes, and the bound
they put on dsa's speed-up.
"""
import math

import torch
import torch.nn.functional as F
from transformers import DeepseekV32Config
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

import model.ops.sparse_attention as sa
import model.ops.sparse_attention.lightning_indexer as li
from model.ops.sparse_attention.attention import SPARSE_KEY_COST
from model import DecoderLM, LMConfig
from model.layers import RotaryEmbedding
from model.mixers.dsa import indexer_kl
from model.mixers.softmax import attend
from scripts.benchmarks.common import ROOT, cpu_times, markdown_table, matmul_peak_gflops, saved_activation_bytes

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
    return li.index_topk(x["q_i"], x["k_i"], x["w"], TOPK)


def path_loss(x: dict, idx: torch.Tensor, path) -> torch.Tensor:
    return (path(x["q"], x["k"], x["v"], idx) * x["grad"]).sum()


def dsa_loss(x: dict, with_kl: bool = True) -> torch.Tensor:
    """The mixer's sparse-stage core: select, attend by the dispatched path, indexer KL."""
    sel = sa.Selection(selection(x), x["k"].shape[1])
    o, p = sa.selected_attention(x["q"], x["k"], x["v"], sel, with_probs=with_kl)
    loss = (o * x["grad"]).sum()
    return loss + indexer_kl(p, li.index_scores_at(x["q_i"], x["k_i"], x["w"], sel)) if with_kl else loss


def indexer_kl_loss(x: dict, idx: torch.Tensor) -> torch.Tensor:
    """The sparse stage's indexer loss given the selection: KL(attention probs || indexer softmax)."""
    return indexer_kl(sa.selected_attention_probs(x["q"], x["k"], idx), li.index_scores_at(x["q_i"], x["k_i"], x["w"], idx))


def fwd_bwd(loss_fn):
    return lambda: loss_fn().backward()


def forward_only(fn):
    def step():
        with torch.no_grad():
            fn()
    return step


def hf_masked_peer(T: int, kv_heads: int = H, backward: bool = False):
    """transformers' DSA: DeepseekV32Indexer top-k -> boolean mask -> SDPA (dense cost)."""
    d = 256
    cfg = DeepseekV32Config(hidden_size=d, q_lora_rank=d, index_n_heads=H_I, index_head_dim=D_I,
                            qk_rope_head_dim=D_I // 2, index_topk=TOPK)
    indexer = DeepseekV32Indexer(cfg, 0)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, d, generator=g)
    q = torch.randn(B, H, T, D, generator=g).requires_grad_(backward)
    k, v = (torch.randn(B, kv_heads, T, D, generator=g).requires_grad_(backward) for _ in range(2))
    grad = torch.randn(B, H, T, D, generator=g)
    cos, sin = RotaryEmbedding(D_I // 2).cos_sin(0, T, "cpu")
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]

    def step():
        with torch.no_grad():
            idx = indexer(hidden, hidden, (cos[None], sin[None]), causal, None)
            selected = torch.zeros(B, T, T, dtype=torch.bool).scatter(-1, idx.long(), True)
        with torch.set_grad_enabled(backward):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=(selected & causal)[:, None],
                                               enable_gqa=kv_heads != H)
            if backward:
                (o * grad).sum().backward()
    return step


def measure(cases: dict, rounds: int) -> dict:
    """Median CPU seconds per case over rounds, the cases taking turns within each round (each round's
    call to a case follows one warm-up call of it)."""
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name] += cpu_times(fn, iters=1)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def sparse_gflops(x: dict, idx: torch.Tensor, seconds: float) -> float:
    """fwd (q.k and p.v) + bwd (dp, dq, dk, dv): 6 products of 2 D FLOPs per selected (query head, key)."""
    return 6 * 2 * D * H * int((idx >= 0).sum()) / seconds / 1e9


def components(T: int, rounds: int) -> tuple[str, dict]:
    x, mqa = make_inputs(T), make_inputs(T, kv_heads=1)
    idx = selection(x)
    core = "DSA core fwd+bwd (index + top-k + attention + indexer KL)"
    cases = {
        "dense SDPA fwd+bwd": fwd_bwd(lambda: dense_loss(x)),
        core: fwd_bwd(lambda: dsa_loss(x)),
        "DSA index + top-k + attention fwd+bwd (the peer's work)": fwd_bwd(lambda: dsa_loss(x, with_kl=False)),
        "transformers DeepseekV32Indexer + top-k-masked SDPA fwd+bwd": hf_masked_peer(T, backward=True),
        "  index + top-k (no grad)": forward_only(lambda: selection(x)),
        "  sparse path fwd+bwd (given indices)": fwd_bwd(lambda: path_loss(x, idx, sa.sparse_attention)),
        "  masked path fwd+bwd (given indices)": fwd_bwd(lambda: path_loss(x, idx, sa.masked_attention)),
        "  indexer KL fwd+bwd (given indices)": fwd_bwd(lambda: indexer_kl_loss(x, idx)),
        "dense SDPA fwd": forward_only(lambda: dense_loss(x)),
        "DSA core fwd": forward_only(lambda: dsa_loss(x, with_kl=False)),
        "transformers DeepseekV32Indexer + top-k-masked SDPA fwd": hf_masked_peer(T),
        "dense SDPA fwd+bwd, 1 KV head (MQA)": fwd_bwd(lambda: dense_loss(mqa)),
        "DSA core fwd+bwd, 1 KV head (MQA, as DeepSeek's MLA)": fwd_bwd(lambda: dsa_loss(mqa)),
    }
    t = measure(cases, rounds)
    mem = {name: saved_activation_bytes(fn) for name, fn in
           (("dense SDPA fwd+bwd", lambda: dense_loss(x)), (core, lambda: dsa_loss(x)))}
    base = t["dense SDPA fwd+bwd"]
    rows = [[name, f"{1e3 * s:.1f}", f"{base / s:.2f}x", f"{mem[name] / 2**20:.1f}" if name in mem else ""]
            for name, s in t.items()]
    return markdown_table(["case", "CPU ms", "speed-up vs dense fwd+bwd", "saved activations MiB"], rows), \
        dict(t=t, gflops=sparse_gflops(x, idx, t["  sparse path fwd+bwd (given indices)"]))


def peer_scaling(lengths: list[int], rounds: int) -> tuple[str, dict]:
    rows, curves = [], {"dense SDPA": [], "DSA core": [], "transformers masked DSA": []}
    for T in lengths:
        x = make_inputs(T)
        idx = selection(x)
        cases = {"dense": fwd_bwd(lambda: dense_loss(x)), "core": fwd_bwd(lambda: dsa_loss(x)),
                 "ours": fwd_bwd(lambda: dsa_loss(x, with_kl=False)), "peer": hf_masked_peer(T, backward=True),
                 "ours fwd": forward_only(lambda: dsa_loss(x, with_kl=False)), "peer fwd": hf_masked_peer(T),
                 "sparse": fwd_bwd(lambda: path_loss(x, idx, sa.sparse_attention)),
                 "masked": fwd_bwd(lambda: path_loss(x, idx, sa.masked_attention))}
        t = measure(cases, rounds)
        for name, key in (("dense SDPA", "dense"), ("DSA core", "core"), ("transformers masked DSA", "peer")):
            curves[name].append(t[key])
        chosen = sa.attention_path(T, T, TOPK, H, H, "cpu")
        # the sparse path's cost per selected key over the masked path's per visible key (SPARSE_KEY_COST)
        key_cost = (t["sparse"] / (T * TOPK)) / (t["masked"] / (T * T / 2))
        rows.append([T, f"{1e3 * t['dense']:.0f}", f"{1e3 * t['core']:.0f}", f"{t['dense'] / t['core']:.2f}x",
                     f"{t['peer'] / t['ours']:.2f}x", f"{t['peer fwd'] / t['ours fwd']:.2f}x",
                     f"{1e3 * t['sparse']:.0f} / {1e3 * t['masked']:.0f}", chosen, f"{key_cost:.1f}"])
    header = ["T", "dense SDPA ms", "DSA core ms", "core vs dense", "vs transformers fwd+bwd",
              "vs transformers fwd", "sparse / masked path ms", "cost model picks", "measured key cost"]
    return markdown_table(header, rows), curves


def model_step(mixer: str, kv_heads: int, T: int):
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=512, hidden_size=256, num_hidden_layers=1, num_attention_heads=H,
                   num_key_value_heads=kv_heads, intermediate_size=768, max_position_embeddings=T,
                   mixer=mixer, mixer_options={"dsa": {"topk": TOPK, "index_heads": H_I, "index_head_dim": D_I}})
    lm = DecoderLM(cfg)
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-4)
    batch = torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(0))

    def step():
        lm(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def crossover(lengths: list[int], ratios: list[float]) -> str:
    """First T where dsa/softmax tokens/s reaches 1, log-interpolated between the measured lengths."""
    for (t0, r0), (t1, r1) in zip(zip(lengths, ratios), zip(lengths[1:], ratios[1:])):
        if r0 < 1 <= r1:
            f = math.log(r0) / (math.log(r0) - math.log(r1))
            return f"~{round(t0 * (t1 / t0) ** f)} (between {t0} and {t1})"
    if ratios[0] >= 1:
        return f"<= {lengths[0]}"
    return f"> {lengths[-1]}"


def model_level(lengths: list[int], rounds: int) -> str:
    rows, notes = [], []
    for kv in (1, H):
        ratios = []
        for T in lengths:
            t = measure({"softmax": model_step("softmax", kv, T), "dsa": model_step("dsa", kv, T)}, rounds)
            ratios.append(t["softmax"] / t["dsa"])
            rows.append([kv, T, f"{B * T / t['softmax']:,.0f}", f"{B * T / t['dsa']:,.0f}", f"{ratios[-1]:.2f}x"])
        notes.append(f"crossover with {kv} KV head{'s' if kv > 1 else ''}: T {crossover(lengths, ratios)}")
    return markdown_table(["KV heads", "T", "softmax tokens/s", "dsa tokens/s", "dsa / softmax"], rows) + \
        "\n\n" + "; ".join(notes)


def step_breakdown(T: int, rounds: int) -> str:
    """Where a 1-KV-head model step goes at length T. Both models share everything but the attention
    (the rest: projections, FFN, lm_head, AdamW), so dsa / softmax tokens/s = (rest + dense) / (rest +
    core) lies between 1 and dense / core: dsa reaches r > 1 x softmax's tokens/s only if its core
    (index + top-k + attention + indexer KL) takes under 1 / r of dense SDPA fwd+bwd."""
    x = make_inputs(T, kv_heads=1)
    idx = selection(x)
    t = measure({
        "softmax model step": model_step("softmax", 1, T),
        "dsa model step": model_step("dsa", 1, T),
        "dense SDPA fwd+bwd": fwd_bwd(lambda: dense_loss(x)),
        "DSA core fwd+bwd": fwd_bwd(lambda: dsa_loss(x)),
        "  index + top-k (no grad)": forward_only(lambda: selection(x)),
        "  sparse path fwd+bwd (given indices)": fwd_bwd(lambda: path_loss(x, idx, sa.sparse_attention)),
        "  indexer KL fwd+bwd (given indices)": fwd_bwd(lambda: indexer_kl_loss(x, idx)),
    }, rounds)
    dense = t["dense SDPA fwd+bwd"]
    rows = [[name, f"{s:.2f}", "" if "model" in name else f"{s / dense:.2f}"] for name, s in t.items()]
    return markdown_table(["part", "CPU s", "/ dense SDPA fwd+bwd"], rows) + \
        (f"\n\ndsa / softmax step speed-up {t['softmax model step'] / t['dsa model step']:.2f}x, which lies between 1 "
         f"and dense / core = {dense / t['DSA core fwd+bwd']:.2f}x; 2x needs the core under {dense / 2:.2f} s.")


def run(quick: bool) -> str:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    T_head = 1024 if quick else 4096
    peer_lengths = [512, 1024] if quick else [1024, 2048, 4096, 8192]
    model_lengths = [1024, 2048] if quick else [2048, 4096, 8192, 16384]
    rounds = 1 if quick else 3
    peak = matmul_peak_gflops()
    table, head = components(T_head, rounds)
    report = [f"B={B}, T={T_head}, H={H} (KV heads {H} unless noted), D={D}, indexer {H_I} heads x {D_I}, top-k "
              f"{TOPK}; fp32, 1 thread, median 1-thread process CPU time of {rounds} interleaved rounds. "
              f"Sparse path: {head['gflops']:.1f} GFLOP/s fwd+bwd = {100 * head['gflops'] / peak:.0f}% of the "
              f"1-thread fp32 matmul peak measured in this run ({peak:.0f} GFLOP/s).", "", table]
    scaling, curves = peer_scaling(peer_lengths, rounds)
    report += ["", f"Scaling, fwd+bwd unless noted (top-k {TOPK}, {H} KV heads); 'vs transformers' is its time "
               "over ours for the same work (index + top-k + attention); the measured key cost is the sparse "
               "path's time per selected key over the masked path's per visible key (the cost model uses "
               f"{SPARSE_KEY_COST['cpu']}):", "", scaling, "", f"Plot: {plot(peer_lengths, curves)}"]
    report += ["", "Model level, 1-layer d 256 LM, fwd + bwd + AdamW, B 1:", "", model_level(model_lengths, rounds)]
    report += ["", f"Where a step goes at T {model_lengths[-1]}, 1 KV head (the DSA parts at the model's shapes):", "",
               step_breakdown(model_lengths[-1], rounds)]
    return "\n".join(report)


def plot(lengths: list[int], curves: dict) -> str:
    from common.plots import legend_outside, pyplot, save_figure

    path = ROOT / "outputs" / "bench" / "dsa_scaling.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = pyplot().subplots(figsize=(5, 3.5))
    for name, ys in curves.items():
        ax.plot(lengths, [1e3 * y for y in ys], marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="fwd+bwd CPU ms (1 thread)",
           title=f"attention core, B={B} H={H} D={D}, top-k {TOPK}")
    ax.minorticks_off()
    ax.set_xticks(lengths, [str(t) for t in lengths])
    legend_outside(ax)
    save_figure(fig, path)
    return str(path.relative_to(ROOT))
