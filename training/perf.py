"""Throughput accounting: device peak FLOP/s for MFU, and the matmul peak of this CPU.

GPU peaks come from a table of dense (non-sparse) tensor-core figures per dtype. A CPU has no
spec-sheet number worth trusting, so its fp32 matmul peak is measured once (1024^3 matmuls) and
cached in ~/.cache/swaplm/cpu_peak.json keyed by CPU model and thread count.
"""
import json
import os
import platform
import time
from pathlib import Path

import torch

# Dense peak TFLOP/s (bf16, tf32-or-fp32) by substring of the CUDA device name.
GPU_PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp32": 494.0},
    "H100": {"bf16": 989.0, "fp32": 494.0},
    "A100": {"bf16": 312.0, "fp32": 156.0},
    "L40S": {"bf16": 362.0, "fp32": 183.0},
    "A10G": {"bf16": 125.0, "fp32": 62.5},
    "L4": {"bf16": 121.0, "fp32": 60.0},
    "RTX 4090": {"bf16": 165.0, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "fp32": 35.6},
    "V100": {"bf16": 125.0, "fp32": 15.7},
    "T4": {"bf16": 65.0, "fp32": 8.1},
}


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


def cpu_peak_flops() -> float:
    key = f"{platform.processor() or platform.machine()}|{torch.get_num_threads()}threads|torch{torch.__version__}"
    path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "swaplm" / "cpu_peak.json"
    cached = json.loads(path.read_text()) if path.exists() else {}
    if key not in cached:
        cached[key] = matmul_peak_gflops() * 1e9
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cached))
        tmp.replace(path)
    return cached[key]


def device_peak_flops(device: torch.device, bf16: bool) -> float | None:
    """Peak FLOP/s of one device for MFU; None for an unknown GPU (MFU is then not reported)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAK_TFLOPS.items():
            if key in name:
                return peaks["bf16" if bf16 else "fp32"] * 1e12
        return None
    return cpu_peak_flops()


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory, or on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux
