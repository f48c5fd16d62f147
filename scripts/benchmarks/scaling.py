"""Per-token training cost against sequence length, for every registered mixer.

A 2-layer DecoderLM (d 256, 4 heads, vocab 512, SwiGLU, each mixer's default options) runs fwd+bwd
at a fixed number of tokens per batch (B * T = 8192; 2048 with --quick) as T grows; the figure is
seconds per token. A mixer whose cost per token is independent of T (the linear ones: constant state,
chunked scan) stays flat, so t(T_max) / t(256) ~ 1 (target < 1.3); softmax attention's per-token cost
grows with T. The last column is the same ratio in one-thread CPU time (time.process_time, best of
the iterations), which other processes on the machine barely disturb. Mixers that fail to build or
run are listed with the error. Plot: outputs/bench/scaling.png.
"""
from pathlib import Path

import torch

from model import MIXERS, DecoderLM, LMConfig
from scripts.benchmarks.common import cpu_times, markdown_table, time_call

ROOT = Path(__file__).resolve().parents[2]


def train_step(name: str, T: int, tokens: int):
    """fwd+bwd of a fresh 2-layer model with `name` mixers on (tokens / T) x T random ids."""
    torch.manual_seed(0)
    config = LMConfig(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                      mixer=name, max_position_embeddings=T)
    model = DecoderLM(config).train()
    ids = torch.randint(0, 512, (tokens // T, T))

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
    return step


def cpu_seconds_one_thread(step, iters: int) -> float:
    """Best-of-iters CPU time (time.process_time) on one thread: barely disturbed by other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return min(cpu_times(step, iters))
    finally:
        torch.set_num_threads(threads)


def plot(results: dict, lengths: list[int], path: Path) -> None:
    from common.plots import legend_outside, pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(6, 4))
    for name, times in results.items():
        ax.plot(lengths[: len(times)], [t * 1e6 for t in times], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T (tokens per batch fixed)")
    ax.set_ylabel("fwd+bwd microseconds per token")
    ax.set_title("2-layer d=256 model, per-token training cost")
    legend_outside(ax)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)


def run(quick: bool) -> str:
    lengths = [256, 512] if quick else [256, 512, 1024, 2048, 4096]
    tokens, iters = (2048, 1) if quick else (8192, 2)
    results, cpu_ratio, failures = {}, {}, []
    for name in MIXERS.names():
        times = []
        try:
            for T in lengths:
                times.append(time_call(train_step(name, T, tokens), warmup=1, iters=iters) / tokens)
            ends = [cpu_seconds_one_thread(train_step(name, T, tokens), iters) for T in (lengths[0], lengths[-1])]
            cpu_ratio[name] = ends[1] / ends[0]
        except Exception as err:  # a mixer that cannot build or run at these shapes is reported, not fatal
            failures.append(f"- `{name}` failed at T={T}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
        if times:
            results[name] = times
    ratio = f"t({lengths[-1]})/t({lengths[0]})"
    rows = [[name] + [f"{t * 1e6:.1f}" for t in times] + ["-"] * (len(lengths) - len(times))
            + [f"{times[-1] / times[0]:.2f}" if len(times) == len(lengths) else "-",
               f"{cpu_ratio[name]:.2f}" if name in cpu_ratio else "-"] for name, times in results.items()]
    path = ROOT / "outputs" / "bench" / "scaling.png"
    plot(results, lengths, path)
    report = (f"fwd+bwd microseconds per token, 2-layer d 256 model, B x T = {tokens}, "
              f"torch threads {torch.get_num_threads()}:\n\n"
              + markdown_table(["mixer"] + [f"T={T}" for T in lengths] + [ratio, f"{ratio}, 1-thread CPU time"], rows)
              + f"\n\nPlot: {path.relative_to(ROOT)}")
    if failures:
        report += "\n\nNot measured:\n" + "\n".join(failures)
    return report
