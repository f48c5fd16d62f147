"""Throughput accounting: the peak FLOP/s that MFU divides by, and CPU contention.

GPU peaks come from NVIDIA's datasheets (dense, no 2:4 sparsity; `scripts/gpu_check.py` measures the
bf16 matmul peak of the card at hand and prints it beside the table). A CPU has no datasheet number
worth trusting, so its fp32 matmul peak is measured: the best of several spaced 1024^3 matmul runs,
cached in ~/.cache/swaplm/cpu_peak.json (keyed by CPU model, thread count and torch version) only
when no other process kept the cores busy during the measurement, so that one loaded moment cannot
poison every later MFU. Every peak says where it came from (`Peak.describe`).

A second process on the cores torch's threads use makes those threads wait on each other (a
training run slows several-fold); `ContentionMonitor` notices it from /proc/stat and says so once.
"""
import json
import os
import platform
import re
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from common.files import written_then_renamed


@dataclass(frozen=True)
class GpuPeak:
    """Dense peak TFLOP/s of one card: bf16 and tf32 on tensor cores (fp32 accumulation), fp32 on
    CUDA cores. bf16/tf32 None: the card has no such tensor cores."""
    pattern: str  # regex searched in torch.cuda.get_device_name()
    label: str
    bf16: float | None
    tf32: float | None
    fp32: float


# Datasheet values, dense. Checked in order: the first pattern found in the device name wins.
GPU_PEAKS = [
    GpuPeak(r"H200 NVL", "H200 NVL", 835.5, 417.5, 60.0),
    GpuPeak(r"H200|GH200", "H200 / GH200 (SXM class)", 989.4, 494.7, 67.0),
    GpuPeak(r"H100 NVL", "H100 NVL", 835.5, 417.5, 60.0),
    GpuPeak(r"H100 PCIe", "H100 PCIe", 756.5, 378.0, 51.0),
    GpuPeak(r"H100 (SXM|80GB HBM3)", "H100 SXM", 989.4, 494.7, 67.0),  # the SXM part reports "H100 80GB HBM3"
    GpuPeak(r"A100", "A100 (SXM or PCIe)", 312.0, 156.0, 19.5),
    GpuPeak(r"L40S", "L40S", 362.05, 183.0, 91.6),
    GpuPeak(r"\bL4\b", "L4", 121.0, 60.0, 30.3),
    GpuPeak(r"\bA10\b", "A10", 125.0, 62.5, 31.2),  # not A10G: its tensor figures are not published
    GpuPeak(r"RTX 4090", "RTX 4090", 165.2, 82.6, 82.6),  # GeForce: fp32 accumulation runs at half the fp16 rate
    GpuPeak(r"RTX 3090", "RTX 3090", 71.0, 35.6, 35.6),
    GpuPeak(r"V100", "V100", None, None, 15.7),  # the SXM2 part (PCIe: 14.0); Volta tensor cores: fp16 only
    GpuPeak(r"\bT4\b", "T4", None, None, 8.1),  # Turing tensor cores: fp16, int8, int4
]


@dataclass(frozen=True)
class Peak:
    """The FLOP/s MFU divides by (None: unknown, MFU is not reported) and where it came from."""
    flops: float | None
    source: str
    device_type: str = "cuda"
    remeasured: bool = False  # a CPU peak measured again after an implausible MFU (recheck_peak does it once)

    def describe(self) -> str:
        if self.flops is None:
            return f"MFU peak: none ({self.source}); MFU is not reported"
        unit, div = ("TFLOP/s", 1e12) if self.flops >= 1e12 else ("GFLOP/s", 1e9)
        return f"MFU peak: {self.flops / div:,.1f} {unit} ({self.source})"


def gpu_peak(device_name: str, precision: str) -> Peak:
    """Datasheet peak of a CUDA device for precision 'bf16', 'tf32' or 'fp32'. V100 and T4 have no bf16
    or tf32 units at all (torch emulates bf16 there through fp32), so such a request gets the fp32
    CUDA-core peak: an upper bound for those matmuls, not a bf16 datasheet figure (there is none)."""
    for row in GPU_PEAKS:
        if re.search(row.pattern, device_name):
            tflops = getattr(row, precision)
            if tflops is None:
                return Peak(row.fp32 * 1e12, f"{row.label} has no {precision} tensor cores: fp32 CUDA-core peak, datasheet")
            kind = "CUDA cores" if precision == "fp32" else "tensor cores, dense"
            return Peak(tflops * 1e12, f"{row.label} {precision} {kind}, datasheet")
    return Peak(None, f"{device_name!r} is not in training/perf.py's GPU_PEAKS")


def cuda_fp32_precision() -> str:
    """What fp32 matmuls run as: 'tf32' when torch may use TF32 tensor cores, else 'fp32'."""
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


# --- CPU ------------------------------------------------------------------------------------------

def matmul_peak_gflops(n: int = 1024, repeats: int = 10, dtype=torch.float32) -> float:
    """Best-of-`repeats` GFLOP/s of an n x n x n matmul on the CPU with the current thread count."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def read_cpu_ticks() -> tuple[int, int, int, int] | None:
    """(busy ticks, all ticks) summed over the CPUs this process may run on, this process's own
    ticks (utime + stime), and that CPU count; None where /proc is missing."""
    try:
        stat = Path("/proc/stat").read_text().splitlines()
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    allowed = os.sched_getaffinity(0)
    busy = total = ncpu = 0
    for line in stat:
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in allowed):
            continue
        ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
        busy += sum(ticks) - ticks[3] - ticks[4]
        total += sum(ticks)
        ncpu += 1
    return busy, total, int(own[11]) + int(own[12]), ncpu  # fields 14, 15 of /proc/self/stat


def others_busy_cores(before, after) -> float:
    """Cores kept busy by other processes between two read_cpu_ticks() readings."""
    busy, total, own = (a - b for a, b in zip(after[:3], before[:3]))
    return max(busy - own, 0) * after[3] / total if total > 0 else 0.0


def measure_cpu_peak(samples: int = 5, gap_s: float = 0.1) -> tuple[float, float | None]:
    """(best fp32 matmul FLOP/s of `samples` runs spaced gap_s apart, cores other processes kept
    busy meanwhile, None where unknown)."""
    before = read_cpu_ticks()
    best = 0.0
    for i in range(samples):
        if i:
            time.sleep(gap_s)
        best = max(best, matmul_peak_gflops(repeats=3) * 1e9)
    after = read_cpu_ticks()
    return best, (others_busy_cores(before, after) if before and after else None)


QUIET_BUSY_CORES = 0.25  # other processes' load under which a measurement is cached
_cpu_peak_memo: dict[str, Peak] = {}  # this process's CPU peak per key: measured at most once, unless rechecked


def _cpu_peak_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "swaplm" / "cpu_peak.json"


def _cpu_peak_key() -> str:
    return f"{platform.processor() or platform.machine()}|{torch.get_num_threads()}threads|torch{torch.__version__}"


def cpu_peak(remeasure: bool = False) -> Peak:
    """The CPU's fp32 matmul peak for the current thread count: the cached quiet measurement, else
    one measured now (cached if the cores were quiet). remeasure=True measures again and keeps the
    higher of that and the cache. Entries of the old format (a bare number, possibly measured under
    load) are not trusted and are measured again."""
    key = _cpu_peak_key()
    if key in _cpu_peak_memo and not remeasure:
        return _cpu_peak_memo[key]
    path = _cpu_peak_cache()
    cache = json.loads(path.read_text()) if path.exists() else {}
    entry = cache.get(key) if isinstance(cache.get(key), dict) else None
    what = f"CPU fp32 1024^3 matmul, {torch.get_num_threads()} threads"
    if entry is not None and not remeasure:
        peak = Peak(entry["flops"], f"{what}, cached {entry['measured_at']} in {path}", "cpu")
    else:
        flops, others = measure_cpu_peak()
        quiet = others is not None and others <= QUIET_BUSY_CORES
        load = "load unknown" if others is None else f"other processes kept {others:.1f} cores busy"
        if entry is not None and entry["flops"] >= flops:
            peak = Peak(entry["flops"], f"{what}, cached {entry['measured_at']} (re-measured {flops / 1e9:.0f} GFLOP/s, {load})", "cpu")
        elif quiet:
            entry = {"flops": flops, "measured_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}
            cache[key] = entry
            path.parent.mkdir(parents=True, exist_ok=True)
            with written_then_renamed(path) as tmp:
                tmp.write_text(json.dumps(cache, indent=1))
            peak = Peak(flops, f"{what}, measured now ({load}), cached in {path}", "cpu")
        else:
            peak = Peak(flops, f"{what}, measured now ({load}: not cached, MFU may read high)", "cpu")
    peak = replace(peak, remeasured=remeasure)
    _cpu_peak_memo[key] = peak
    return peak


def device_peak(device: torch.device, bf16: bool) -> Peak:
    """The peak one device of this type reaches in the precision training runs in."""
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), "bf16" if bf16 else cuda_fp32_precision())
    return cpu_peak()


def recheck_peak(peak: Peak, achieved_flops: float) -> Peak:
    """The peak to report MFU against once a device achieved `achieved_flops` FLOP/s: on CPU an MFU
    above 1 means the peak was measured under load, so it is measured again (once); otherwise unchanged."""
    if peak.device_type != "cpu" or peak.flops is None or peak.remeasured or achieved_flops <= peak.flops:
        return peak
    return cpu_peak(remeasure=True)


# --- contention -----------------------------------------------------------------------------------

def contention_message(threads: int, others_busy: float, cores: int) -> str | None:
    """One warning line when torch's threads plus other processes' load oversubscribe the cores."""
    if threads <= cores - others_busy + 0.5:
        return None
    free = max(int(cores - others_busy + 0.5), 1)
    return (f"warning: other processes keep {others_busy:.1f} of this process's {cores} CPU cores busy while torch "
            f"runs {threads} threads; its threads then wait on each other and training can run several times "
            f"slower. Free the cores, or run with OMP_NUM_THREADS={free}.")


def cpu_contention_warning(interval_s: float = 0.3, threads: int | None = None) -> str | None:
    """Measures other processes' CPU load over interval_s (this process idle) and returns
    contention_message's warning, or None (no contention, or no /proc)."""
    before = read_cpu_ticks()
    time.sleep(interval_s)
    after = read_cpu_ticks()
    if before is None or after is None:
        return None
    return contention_message(threads or torch.get_num_threads(), others_busy_cores(before, after), after[3])


class ContentionMonitor:
    """Warns once per run about CPU contention: checked at the start, and again when a log window's
    tokens/s falls below `slow_ratio` of the best window so far."""

    def __init__(self, slow_ratio: float = 0.5):
        self.slow_ratio = slow_ratio
        self.best = 0.0
        self.warned = False

    def check(self) -> str | None:
        if self.warned:
            return None
        message = cpu_contention_warning()
        self.warned = message is not None
        return message

    def after_window(self, tokens_per_sec: float) -> str | None:
        slow = tokens_per_sec < self.slow_ratio * self.best
        self.best = max(self.best, tokens_per_sec)
        return self.check() if slow else None


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory, or on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux
