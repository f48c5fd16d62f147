"""Context parallelism on CPU (trainer.context_parallel): per-rank memory, throughput and bytes sent against sequence
length at CP 1, 2 and 4, for softmax, gdn and mamba2, on gloo processes (torchrun), one row of T tokens a step.

Model: d 256, 2 layers of the mixer, dense SwiGLU, vocabulary 4096, float32, AdamW. Each configuration runs in fresh
processes (1 thread each): one warm-up step, then the peak resident set of each rank is reset (Linux clear_refs)
and one timed training step runs; per rank, its growth over what it held before the step (the activations
and the step's temporaries) and the bytes each kind of exchange sent (ContextGroup.sent). Read the memory as the
largest rank's (the one a device must fit) and the tokens/s as the row's T over the step time (every rank waits
for the slowest). On 2 cores, CP 2 runs 2 single-thread processes and CP 4 four on 2 cores, so tokens/s here
measures overhead, not the speed-up of a rank per GPU; memory per rank is what CP buys and what this measures.

Beside the measured bytes, the cost model (docs/distributed.md#what-each-mixer-sends) per layer and step, forward
and backward, for comparison with an all-gather of the layer's input activations (what a mixer that gathered
its whole sequence would send).

    python scripts/bench.py cp            # the table and outputs/bench/cp.png
    python scripts/bench.py cp --quick    # gdn at 256 tokens, CP 1 and 2: a smoke run
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.benchmarks.common import ROOT, markdown_table

MIXERS = ("softmax", "gdn", "mamba2")
LONGEST_ALONE = {"softmax": 16384, "gdn": 16384, "mamba2": 16384}  # longer: CP 4 only (one process's step there: minutes)
BUDGET_MIB = 2048  # a rank's memory for a step: the longest T each layout fits in it is reported
D, LAYERS, VOCAB = 256, 2, 4096


def model(mixer: str):
    from model import DecoderLM, LMConfig

    return DecoderLM(LMConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=4,
                              num_key_value_heads=4, max_position_embeddings=1 << 17, mixer=mixer))


def rss(field: str) -> int:
    """VmRSS or VmHWM (peak since the last reset) of this process, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(mixer: str, length: int, steps: int, out: Path) -> None:
    """One configuration on the processes torchrun started: every rank trains on the same row, its slice of it."""
    import torch
    import torch.distributed as dist

    from training.parallel import apply_context_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    lm = model(mixer)
    context, _ = apply_context_parallel(lm, world, world, rank, "cpu", length)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-4)
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(1))

    def step():
        out = lm(input_ids=ids, labels=ids, **({} if context is None else {"context": context}))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the first step's allocations (AdamW's state) and first calls
    if context is not None:
        context.take_sent()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set restarts from now
    before = rss("VmRSS")
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    seconds = (time.perf_counter() - t0) / steps
    sent = {k: v / steps for k, v in (context.take_sent() if context is not None else {}).items()}
    result = {"rank": rank, "growth": rss("VmHWM") - before, "peak": rss("VmHWM"), "seconds": seconds, "sent": sent}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(mixer: str, length: int, cp: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(cp), "--master_port",
               str(free_port()), "-m", "scripts.benchmarks.cp", mixer, str(length), str(steps), tmp]
        # every allocation of 128 KiB or more its own mapping, returned on free: the resident set then follows the
        # live tensors (glibc would otherwise keep freed blocks in its heap, hiding a later step's growth)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            return {"error": proc.stderr[-300:].replace("\n", " ")}
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    return {"growth": max(r["growth"] for r in ranks), "peak": max(r["peak"] for r in ranks),
            "seconds": max(r["seconds"] for r in ranks), "sent": ranks[-1]["sent"]}


def model_bytes(mixer: str, length: int, cp: int) -> dict:
    """The cost model per layer and step (forward and backward), bytes sent by the last rank, float32: what the mixer
    exchanges, and an all-gather of the layer's input activations [T / P, d] for comparison."""
    lm = model(mixer)
    m = lm.layers[0].mixer
    P, L, f = cp, length // cp, 4
    gather = 2 * (P - 1) * L * D * f  # all-gather forward, reduce-scatter backward
    if mixer == "softmax":
        sends = 2 * 2 * (P - 1) * L * m.num_kv_heads * m.head_dim * f
    elif mixer == "gdn":
        chain = m.num_v_heads * (m.head_dim ** 2 + m.head_dim * m.head_v_dim)
        halo = (m.conv_size - 1) * (2 * m.key_dim + m.value_dim)
        sends = 2 * (P - 1) * chain * f + 2 * halo * f
    else:
        chain = m.num_heads * (1 + m.head_dim * m.state_size)
        halo = (m.conv.kernel_size - 1) * m.conv.conv.in_channels
        sends = 2 * (P - 1) * chain * f + 2 * halo * f
    return {"mixer": sends, "activations": gather}


def run(quick: bool) -> str:
    from common.plots import LINE_STYLES, PALETTE, legend_outside, pyplot, save_figure

    mixers, lengths, sizes = (("gdn",), (256,), (1, 2)) if quick else (MIXERS, (2048, 4096, 8192, 16384, 32768), (1, 2, 4))
    steps = 1
    rows, points = [], {}
    for mixer in mixers:
        for length in lengths:
            base = None
            for cp in sizes:
                if not quick and length > LONGEST_ALONE[mixer] and cp < 4:
                    continue  # past what one process (and for softmax two) ran here in reasonable time: CP 4 only
                r = measure(mixer, length, cp, steps)
                if "error" in r:
                    rows.append([mixer, length, cp, "failed", "", "", "", "", "", r["error"][:120]])
                    continue
                base = base or (r if cp == 1 else None)
                model_sent = model_bytes(mixer, length, cp) if cp > 1 else {"mixer": 0, "activations": 0}
                per_layer = (r["sent"].get("gather", 0) + r["sent"].get("shift", 0)) / LAYERS
                rows.append([mixer, length, cp, f"{r['growth'] / 2**20:.0f}",
                             f"{r['growth'] / base['growth']:.2f}" if base else "-",
                             f"{r['peak'] / 2**20:.0f}", f"{length / r['seconds']:.0f}",
                             f"{base['seconds'] / r['seconds']:.2f}" if base else "-",
                             f"{per_layer / 2**10:.1f}" if cp > 1 else "-",
                             f"{model_sent['mixer'] / 2**10:.1f} / {model_sent['activations'] / 2**10:.1f}" if cp > 1 else "-"])
                points.setdefault((mixer, cp), []).append((length, r["growth"] / 2**20))
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for (mixer, cp), pts in points.items():
        ax.plot(*zip(*pts), marker="o", label=f"{mixer}, CP {cp}", color=PALETTE[MIXERS.index(mixer)],
                linestyle=LINE_STYLES[(1, 2, 4).index(cp)])
    ax.axhline(BUDGET_MIB, color="grey", linewidth=0.8, linestyle="-.", label=f"a {BUDGET_MIB // 1024} GiB budget")
    ax.set(xscale="log", yscale="log", xlabel="sequence length T (one row)", ylabel="step memory per rank, MiB (largest rank)",
           title="Context parallelism on CPU: memory per rank against T")
    ax.set_xticks(lengths, [str(t) for t in lengths])
    ax.minorticks_off()
    legend_outside(ax)
    out = ROOT / "outputs" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    path = save_figure(fig, out / "cp.png")
    fits = {}
    for (mixer, cp), pts in points.items():
        fits.setdefault(mixer, []).append(f"CP {cp} {max((t for t, mib in pts if mib <= BUDGET_MIB), default='none')}")
    longest = "; ".join(f"{mixer}: {', '.join(sizes_fit)}" for mixer, sizes_fit in fits.items())
    return (f"The longest T whose step fits {BUDGET_MIB} MiB per rank, of those run: {longest}.\n\n"
            f"d {D}, {LAYERS} layers of the mixer, vocabulary {VOCAB}, float32, AdamW, one row a step, gloo, 1 thread per "
            f"process; {steps} step(s) after 1 warm-up step. Memory: the largest rank's peak resident set during the steps "
            f"over what it held before them (and its whole peak). Bytes: the last rank's, per layer and step, forward + "
            f"backward, measured / the cost model's ({'mixer'} / an all-gather of the layer's input activations).\n\n"
            + markdown_table(["mixer", "T", "CP", "step memory / rank MiB", "vs CP 1", "peak RSS / rank MiB", "tokens/s",
                              "vs CP 1", "KiB sent / layer / step", "model: mixer / activations KiB"], rows)
            + f"\n\nPlot: {path}")


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
