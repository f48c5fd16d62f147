"""training/perf.py: the GPU peak table, the CPU peak cache that a loaded moment cannot poison, and the
CPU contention warning (timers and /proc readings replaced; no timing is asserted)."""
import json

import pytest
import torch

from training import perf


@pytest.mark.parametrize("name, precision, tflops, needle", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4, "H100 SXM bf16"),
    ("NVIDIA H100 PCIe", "bf16", 756.5, "H100 PCIe"),
    ("NVIDIA H100 NVL", "bf16", 835.5, "H100 NVL"),
    ("NVIDIA H200", "bf16", 989.4, "H200"),
    ("NVIDIA H200 NVL", "tf32", 417.5, "H200 NVL"),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0, "A100"),
    ("NVIDIA A10", "bf16", 125.0, "A10 bf16"),
    ("NVIDIA H100 PCIe", "fp32", 51.0, "CUDA cores"),
    ("Tesla V100-SXM2-16GB", "bf16", 15.7, "V100 has no bf16 tensor cores"),
    ("Tesla T4", "bf16", 8.1, "T4 has no bf16 tensor cores"),
    ("Tesla V100-SXM2-16GB", "tf32", 15.7, "no tf32"),
])
def test_gpu_peak_rows(name, precision, tflops, needle):
    peak = perf.gpu_peak(name, precision)
    assert peak.flops == pytest.approx(tflops * 1e12)
    assert needle in peak.source and "datasheet" in peak.source


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA H100", "NVIDIA B200"])
def test_unknown_gpu_has_no_peak(name):
    peak = perf.gpu_peak(name, "bf16")
    assert peak.flops is None
    assert "MFU is not reported" in peak.describe() and name in peak.describe()


def test_device_peak_follows_the_fp32_matmul_precision(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")
    assert perf.device_peak(cuda, bf16=True).flops == pytest.approx(989.4e12)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert perf.device_peak(cuda, bf16=False).flops == pytest.approx(67e12)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert perf.device_peak(cuda, bf16=False).flops == pytest.approx(494.7e12)


@pytest.fixture
def cpu_cache(tmp_path, monkeypatch):
    """An empty peak cache under tmp_path and a scripted measure_cpu_peak: set `measurements` to the
    (flops, other processes' busy cores) it returns, call after call; `calls` counts them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(perf, "_cpu_peak_memo", {})
    script = {"measurements": [], "calls": 0}

    def measure():
        script["calls"] += 1
        return script["measurements"].pop(0)

    monkeypatch.setattr(perf, "measure_cpu_peak", measure)
    script["path"] = tmp_path / "swaplm" / "cpu_peak.json"
    return script


def test_quiet_measurement_is_cached_and_reused(cpu_cache, monkeypatch):
    cpu_cache["measurements"] = [(200e9, 0.1)]
    first = perf.cpu_peak()
    assert first.flops == 200e9 and "measured now" in first.source and first.device_type == "cpu"
    assert list(json.loads(cpu_cache["path"].read_text()).values())[0]["flops"] == 200e9
    monkeypatch.setattr(perf, "_cpu_peak_memo", {})  # a new process
    again = perf.cpu_peak()
    assert again.flops == 200e9 and "cached" in again.source and cpu_cache["calls"] == 1


def test_loaded_measurement_is_used_but_not_cached(cpu_cache):
    cpu_cache["measurements"] = [(30e9, 1.0)]
    peak = perf.cpu_peak()
    assert peak.flops == 30e9 and "not cached" in peak.source and "1.0 cores busy" in peak.source
    assert not cpu_cache["path"].exists()
    assert perf.cpu_peak() is peak and cpu_cache["calls"] == 1  # measured once per process


def test_old_bare_number_entry_is_measured_again(cpu_cache):
    cpu_cache["path"].parent.mkdir(parents=True)
    cpu_cache["path"].write_text(json.dumps({perf._cpu_peak_key(): 30e9}))  # the old format, maybe poisoned
    cpu_cache["measurements"] = [(180e9, 0.0)]
    assert perf.cpu_peak().flops == 180e9
    assert json.loads(cpu_cache["path"].read_text())[perf._cpu_peak_key()]["flops"] == 180e9


def test_remeasure_keeps_the_higher_of_cache_and_measurement(cpu_cache):
    cpu_cache["measurements"] = [(200e9, 0.0), (50e9, 1.2), (250e9, 0.0)]
    perf.cpu_peak()
    low = perf.cpu_peak(remeasure=True)
    assert low.flops == 200e9 and "re-measured 50 GFLOP/s" in low.source
    high = perf.cpu_peak(remeasure=True)
    assert high.flops == 250e9
    assert list(json.loads(cpu_cache["path"].read_text()).values())[0]["flops"] == 250e9


def test_recheck_remeasures_only_an_implausible_cpu_peak(cpu_cache):
    cpu_cache["measurements"] = [(30e9, 1.0), (200e9, 0.0)]
    peak = perf.cpu_peak()
    assert perf.recheck_peak(peak, 20e9) is peak  # MFU 0.67: plausible
    rechecked = perf.recheck_peak(peak, 60e9)  # MFU 2.0: the peak was measured under load
    assert rechecked.flops == 200e9 and cpu_cache["calls"] == 2
    assert perf.recheck_peak(rechecked, 400e9) is rechecked and cpu_cache["calls"] == 2  # once per run
    gpu = perf.gpu_peak("NVIDIA H200", "bf16")
    assert perf.recheck_peak(gpu, 2e15) is gpu and cpu_cache["calls"] == 2


def test_measure_cpu_peak_is_the_best_of_spaced_samples(monkeypatch):
    samples = iter([50.0, 210.0, 120.0, 90.0])
    sleeps = []
    ticks = iter([(1000, 4000, 100, 2), (1600, 5000, 500, 2)])  # others: (600 - 400) / (1000 / 2) = 0.4 cores
    monkeypatch.setattr(perf, "matmul_peak_gflops", lambda repeats: next(samples))
    monkeypatch.setattr(perf.time, "sleep", sleeps.append)
    monkeypatch.setattr(perf, "read_cpu_ticks", lambda: next(ticks))
    flops, others = perf.measure_cpu_peak(samples=4, gap_s=0.5)
    assert flops == 210e9 and others == pytest.approx(0.4) and sleeps == [0.5] * 3


def test_others_busy_cores_subtracts_this_process():
    assert perf.others_busy_cores((100, 1000, 10, 2), (250, 1200, 60, 2)) == pytest.approx(1.0)
    assert perf.others_busy_cores((100, 1000, 10, 2), (120, 1200, 60, 2)) == 0.0  # clamped


def test_read_cpu_ticks_reads_this_machine():
    ticks = perf.read_cpu_ticks()
    if ticks is None:
        pytest.skip("no /proc")
    busy, total, own, ncpu = ticks
    assert 0 <= busy <= total and own >= 0 and ncpu == len(__import__("os").sched_getaffinity(0))


@pytest.mark.parametrize("threads, others, cores, warns", [
    (2, 1.0, 2, True), (2, 0.3, 2, False), (1, 1.0, 2, False), (8, 3.0, 8, True), (4, 3.0, 8, False)])
def test_contention_message(threads, others, cores, warns):
    message = perf.contention_message(threads, others, cores)
    assert (message is not None) == warns
    if warns:
        assert f"{others:.1f} of this process's {cores} CPU cores" in message and "OMP_NUM_THREADS=" in message


def test_cpu_contention_warning_from_proc_readings(monkeypatch):
    monkeypatch.setattr(perf.time, "sleep", lambda s: None)
    readings = iter([(0, 0, 0, 2), (60, 60, 0, 2)])  # the other core fully busy, this process idle
    monkeypatch.setattr(perf, "read_cpu_ticks", lambda: next(readings))
    assert "OMP_NUM_THREADS=1" in perf.cpu_contention_warning(threads=2)
    monkeypatch.setattr(perf, "read_cpu_ticks", lambda: None)
    assert perf.cpu_contention_warning(threads=2) is None


def test_contention_monitor_warns_once_and_rechecks_slow_windows(monkeypatch):
    checks = []
    answers = iter([None, "warning: contended", "warning: contended"])
    monkeypatch.setattr(perf, "cpu_contention_warning", lambda: checks.append(1) or next(answers))
    monitor = perf.ContentionMonitor()
    assert monitor.check() is None
    assert monitor.after_window(1000.0) is None and monitor.after_window(900.0) is None and len(checks) == 1
    assert monitor.after_window(300.0) == "warning: contended" and len(checks) == 2
    assert monitor.after_window(100.0) is None and monitor.check() is None and len(checks) == 2
