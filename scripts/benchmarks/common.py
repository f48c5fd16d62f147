"""Timing and memory helpers shared by the benchmark suites."""
import time
from pathlib import Path

import torch

from training.perf import matmul_peak_gflops  # noqa: F401  (re-exported for the suites)

ROOT = Path(__file__).resolve().parents[2]  # the repo


def time_call(fn, warmup: int = 2, iters: int = 5) -> float:
    """Median seconds of fn() over `iters` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def interleaved(fns: dict, rounds: int, iters: int) -> dict:
    """Median over rounds of each fn's median time, the fns taking turns within a round."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(time_call(fn, warmup=1, iters=iters))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def cpu_times(fn, iters: int) -> list[float]:
    """CPU seconds (time.process_time) of each of `iters` calls of fn() after one warm-up call: barely
    disturbed by other processes on the machine, unlike wall time."""
    fn()
    times = []
    for _ in range(iters):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return times


def saved_activation_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd saves for backward while running fn() (the activation
    memory of a training step, which is what differs between mixers; measured the same way on CPU
    and GPU). Parameters saved by reference are counted too, once."""
    seen: dict[tuple, int] = {}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.device)
        seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def markdown_table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
