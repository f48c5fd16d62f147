"""scripts/gpu_check.py without a GPU: its CPU checks pass and say that the rest needs CUDA; its
compare helper and exit status catch a mismatch."""
import os
import subprocess
import sys

import pytest
import torch

from scripts import gpu_check
from training import perf

ROOT = gpu_check.ROOT


def test_runs_its_cpu_checks_and_says_it_needs_cuda(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "XDG_CACHE_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "scripts.gpu_check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "no CUDA device" in out and "[cpu] ok" in out and "all checks passed" in out
    assert "CUDA is not available: ran the CPU checks only" in out
    assert "MFU peak:" in out and "H100 PCIe" in out  # the CPU peak used and the GPU table
    assert "[kernels]" not in out and "[train]" not in out


def test_mismatch_within_and_beyond_tolerance():
    want = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    assert gpu_check.mismatch("x", want.clone(), want, 1e-3) is None
    assert gpu_check.mismatch("x", want + 3e-3, want, 1e-3) is None  # 3e-3 <= 1e-3 * max |want| = 4e-3
    line = gpu_check.mismatch("gdn o", want + 1e-2, want, 1e-3)
    assert line.startswith("MISMATCH gdn o:") and "0.01" in line and "tolerance 0.001" in line


def test_mismatch_shape_nonfinite_and_zero_reference():
    want = torch.zeros(3)
    assert "shape (2,), expected (3,)" in gpu_check.mismatch("s", torch.zeros(2), want, 1e-3)
    assert "1 non-finite" in gpu_check.mismatch("n", torch.tensor([0.0, float("nan"), 0.0]), want, 1e-3)
    assert gpu_check.mismatch("z", torch.zeros(3), want, 1e-3) is None
    assert "inf of max |want| = 0" in gpu_check.mismatch("z", torch.tensor([0.0, 1e-6, 0.0]), want, 1e-3)
    assert gpu_check.scalar_mismatch("loss", 6.01, 6.0, 1e-2) is None
    assert gpu_check.scalar_mismatch("loss", 6.1, 6.0, 1e-2).startswith("MISMATCH loss:")


def test_counting_counts_calls_and_restores(monkeypatch):
    import model.ops.ssd as ssd

    original = ssd.mamba_state_step
    with gpu_check.counting("model.ops.ssd", "mamba_state_step") as calls:
        x = gpu_check.ssd_inputs(T=1, P=2, N=3)
        ssd.mamba_state_step(x["x"][:, 0], x["dt"][:, 0], x["A"], x["B"][:, 0], x["C"][:, 0], x["initial_states"])
    assert calls == [1] and ssd.mamba_state_step is original


@pytest.fixture
def quiet_cpu_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(perf, "_cpu_peak_memo", {})
    monkeypatch.setattr(perf, "measure_cpu_peak", lambda: (100e9, 0.0))
    monkeypatch.setattr(gpu_check, "cpu_contention_warning", lambda: None)


def test_cpu_check_catches_a_wrong_path(quiet_cpu_peak, monkeypatch):
    assert gpu_check.check_cpu() == []
    right = gpu_check.op_gdn_recurrent

    def off_by_a_little(**inputs):
        out = right(**inputs)
        return {**out, "o": out["o"] * 1.01}

    monkeypatch.setattr(gpu_check, "op_gdn_recurrent", off_by_a_little)
    lines = gpu_check.check_cpu()
    assert len(lines) == 1 and lines[0].startswith("MISMATCH cpu gdn chunk vs recurrent o:")


def test_main_exits_1_with_one_line_per_mismatch(quiet_cpu_peak, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "check_cpu", lambda: ["MISMATCH a: one", "MISMATCH b: two"])
    assert gpu_check.main([]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-3:] == ["MISMATCH a: one", "MISMATCH b: two", "2 mismatch(es)"]
