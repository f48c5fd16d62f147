"""scripts/gpu_check.py (checks/) without a GPU: both stages' CPU parts pass and say what needs CUDA; a check that
raises, mismatches or overruns its deadline is reported without hiding the others, and the exit status
and JSON say so; the deadlines fit each stage's budget; the kernel cases use the head shapes training
hands fla; the CUDA checks' code runs on CPU tensors; a time-bounded train.py run is stopped and read."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from checks import fla_cases, kernels, model as model_checks, run as run_checks, stage as checks_stage, train as train_checks
from conftest import ROOT, TINY
from scripts import gpu_check
from training import perf


def run_stage(stage: str, tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "XDG_CACHE_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = tmp_path / f"{stage}.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--stage", stage, "--json", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_kernels_stage_runs_its_cpu_part_and_says_what_needs_cuda(tmp_path):
    proc, result = run_stage("kernels", tmp_path)
    out = proc.stdout
    assert "gpu_check stage kernels: budget 4 min 00 s" in out and "no" not in out.splitlines()[1]
    assert "| cpu | 3 | 3 | 0 |" in out and "| fla | - | - | - | - | needs CUDA |" in out
    assert "MFU peak:" in out and "H100 PCIe" in out  # the CPU peak used and the GPU table
    assert "peak, fla, moe, dsa, flex, model, compile need a CUDA GPU" in out and out.rstrip().endswith("all checks passed")
    assert result["passed"] and result["device"] == "cpu" and result["budget_s"] == 240
    assert [(r["check"], r["ok"]) for r in result["results"]] == [("cpu", True)] * 3


@pytest.mark.slow
def test_train_stage_plans_every_mixer_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--stage", "train", "--json", str(tmp_path / "t.json")]) == 0
    out, result = capsys.readouterr().out, json.loads((tmp_path / "t.json").read_text())
    assert "gpu_check stage train: budget 5 min 00 s" in out and "data, train need a CUDA GPU" in out
    assert sorted(result["plan"]) == sorted(checks_stage.MIXERS)
    # model=125m: ~85M non-embedding parameters + 4096 x 768 embeddings; deltaproduct 138M (its 2 Householder steps per
    # token double k's and v's projections and short convs: 1.8M more per layer than gdn's 117M)
    for mixer, plan in result["plan"].items():
        assert 80e6 < plan["parameters"] < 145e6 and plan["forward_flops_per_token"] > 2 * plan["parameters"] * 0.6, mixer


def test_a_failing_check_hides_neither_the_others_nor_the_summary(tmp_path, monkeypatch, capsys):
    def raises_in_setup(stage):
        raise RuntimeError("no such kernel")

    def cases(stage):
        stage.case("raises", lambda: 1 / 0)
        stage.case("mismatches", lambda: [checks_stage.mismatch("x", torch.ones(2), torch.zeros(2) + 2, 1e-3)])
        stage.case("passes", lambda: [None])

    def overruns(stage):
        stage.case("quick", lambda: [])
        time.sleep(30)  # interrupted by the deadline

    checks = [checks_stage.Check("setup", raises_in_setup, 5, needs_cuda=False), checks_stage.Check("cases", cases, 5, needs_cuda=False),
              checks_stage.Check("slow", overruns, 0.3, needs_cuda=False), checks_stage.Check("after", cases, 5, needs_cuda=False),
              checks_stage.Check("gpu", cases, 5)]
    monkeypatch.setitem(run_checks.STAGES, "kernels", (60, checks))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t0 = time.perf_counter()
    assert gpu_check.main(["--stage", "kernels", "--json", str(tmp_path / "k.json")]) == 1
    assert time.perf_counter() - t0 < 10
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "k.json").read_text())
    rows = [(r["check"], r["case"], r["ok"]) for r in result["results"]]
    assert rows == [("setup", "setup", False), ("cases", "raises", False), ("cases", "mismatches", False),
                    ("cases", "passes", True), ("slow", "quick", True), ("slow", "deadline", False),
                    ("after", "raises", False), ("after", "mismatches", False), ("after", "passes", True)]
    assert not result["passed"]
    assert "| cases | 3 | 1 | 2 |" in out and "| gpu | - | - | - | - | needs CUDA |" in out
    assert "MISMATCH setup: raised RuntimeError: no such kernel" in out
    assert "MISMATCH cases raises: raised ZeroDivisionError: division by zero" in out
    assert "MISMATCH slow: its 0.3 s deadline passed after 1 case(s); the rest did not run" in out
    assert out.splitlines()[-1] == "6 mismatch(es)"


@pytest.mark.parametrize("stage", run_checks.STAGES)
def test_deadlines_fit_the_stage_budget(stage):
    """The budget holds by construction: start-up plus every check's deadline."""
    budget, checks = run_checks.STAGES[stage]
    assert budget == {"kernels": 240, "train": 300}[stage]
    assert run_checks.SETUP_S + sum(c.deadline_s for c in checks) <= budget


@pytest.mark.slow
def test_kernel_cases_use_the_head_shapes_training_hands_fla(monkeypatch):
    """A model=125m layer of each fla mixer, run forward on CPU with documents, calls the op with the head
    counts and widths of the kernel cases (so the configs stage kernels autotunes are those training uses)."""
    from model import MIXERS
    from model.segments import DocumentSegments
    import model.mixers.delta_rule as delta_rule_mixer
    import model.mixers.deltaproduct as deltaproduct_mixer
    import model.mixers.linear as linear_mixer
    import model.mixers.mamba2 as mamba2_mixer
    import model.ops.gated_delta.derived as gated_delta

    seen = {}

    def spy(module, name, key, shape_of):
        original = getattr(module, name)

        def spied(*args, **kwargs):
            seen[key] = shape_of(*args)
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, spied)

    spy(delta_rule_mixer, "chunk_gated_delta_rule", "delta_rule_block", lambda q, k, v, *_: (q.shape[2], q.shape[3], v.shape[3]))
    spy(deltaproduct_mixer, "chunk_gated_delta_product", "deltaproduct",
        lambda q, k, v, *_: (q.shape[2], q.shape[3], v.shape[3], k.shape[1] // q.shape[1]))
    spy(gated_delta, "chunk_gated_delta_rule", "derived_gdn", lambda q, k, v, *_: (q.shape[2], q.shape[3], v.shape[3]))
    spy(linear_mixer, "chunk_linear_attn", "linear", lambda q, k, v, *_: (q.shape[2], q.shape[3], v.shape[3]))
    spy(mamba2_mixer, "mamba_chunk_scan", "mamba2", lambda x, dt, A, B, C, *_: (x.shape[2], x.shape[3], B.shape[2], B.shape[3]))
    positions = torch.cat([torch.arange(20), torch.arange(12)])[None]
    with torch.no_grad():
        for mixer in ("gdn", "deltanet", "kda", "gdn2", "deltaproduct", "derived_gdn", "linear", "mamba2"):
            layer = MIXERS.get(mixer)(checks_stage.training_model_config(mixer), 0)
            layer(torch.randn(1, 32, layer_width(layer)), segments=DocumentSegments(positions))
            if "delta_rule_block" in seen:  # gdn, deltanet, kda, gdn2 call the op from DeltaRuleBlock (model/mixers/delta_rule.py)
                seen[mixer] = seen.pop("delta_rule_block")
    cases = {name: inputs for name, _, inputs, *_ in kernels.kernel_cases()}
    q = lambda name: cases[name]["q"]  # noqa: E731
    for mixer in ("gdn", "deltanet", "kda", "gdn2"):
        case = f"{mixer} chunk packed bf16"
        assert seen[mixer] == (q(case).shape[2], q(case).shape[3], cases[case]["v"].shape[3])
    product = cases["deltaproduct chunk packed bf16"]
    assert seen["deltaproduct"] == (*product["q"].shape[2:], product["v"].shape[3], product["k"].shape[1] // product["q"].shape[1])
    assert seen["derived_gdn"] == (q("derived_gdn chunk packed bf16").shape[2], q("derived_gdn chunk packed bf16").shape[3],
                                   cases["derived_gdn chunk packed bf16"]["v"].shape[3])
    assert seen["linear"] == (q("linear packed bf16").shape[2], q("linear packed bf16").shape[3],
                              cases["linear packed bf16"]["v"].shape[3])
    ssd = cases["mamba2 ssd packed bf16"]
    assert seen["mamba2"] == (ssd["x"].shape[2], ssd["x"].shape[3], ssd["B"].shape[2], ssd["B"].shape[3])
    assert all(c["cu_seqlens"] is not None for name, c in cases.items() if "packed" in name)


def layer_width(layer) -> int:
    return next(p for p in layer.parameters() if p.dim() == 2).shape[1]


@pytest.mark.slow
def test_cuda_checks_run_on_cpu_tensors():
    """moe, dsa and flex on CPU tensors: every case runs and agrees; the only problems are that the CUDA
    kernels they assert (torch._grouped_mm, FlexAttention) did not run."""
    stage = checks_stage.Stage("kernels", 600, cuda=True, device="cpu")
    checks = {"moe": kernels.check_moe, "dsa": lambda s: kernels.check_dsa(s, T=40, topk=8), "flex": model_checks.check_flex}
    stage.run([checks_stage.Check(name, fn, 300) for name, fn in checks.items()])
    assert [(r["check"], r["case"]) for r in stage.rows] == [
        ("moe", "bf16 autocast takes torch._grouped_mm"), ("moe", "grouped mm vs CPU loop, fwd + bwd"),
        ("dsa", "1 KV heads"), ("dsa", "2 KV heads"), ("dsa", "4 KV heads"), ("flex", "float32"), ("flex", "bfloat16")]
    assert stage.problems() == ["MISMATCH moe: bf16 autocast on CUDA did not run torch._grouped_mm"] + \
        ["MISMATCH flex: attend did not call FlexAttention on CUDA"] * 2


def test_summarize_run():
    row = lambda step, loss, tok=1000.0, mfu=0.3: {"step": step, "train/loss": loss, "perf/tokens_per_sec": tok,  # noqa: E731
                                                   "perf/mfu": mfu, "perf/peak_mem_gb": 10.0 + step}
    result, problems = train_checks.summarize_run([row(5, 8.3, tok=10.0), row(10, 7.0, 900.0), row(15, 6.5, 1100.0), {"step": 15, "val/loss": 6}])
    assert problems == [] and result["tokens_per_sec"] == 1000.0  # the median of the windows after the first and result["peak_mem_gb"] == 25.0
    assert (result["loss_first"], result["loss_last"], result["windows"], result["steps"]) == (8.3, 6.5, 3, 15)
    assert train_checks.summarize_run([row(5, 8.3), row(10, 8.4)])[1] == ["train loss did not fall (8.300 -> 8.400)"]
    assert train_checks.summarize_run([row(5, 8.3), row(10, 7.0, mfu=1.2)])[1][0].startswith("MFU 1.20 > 1")
    assert train_checks.summarize_run([row(5, 8.3)])[1] == [f"only 1 log window(s) of {train_checks.LOG_EVERY} steps in the time given"]


@pytest.mark.slow
def test_train_check_stops_a_run_at_its_slot_and_reads_it(monkeypatch, data_cache):
    """check_train on CPU with the tiny config: train.py runs past its share of the deadline, is stopped
    (SIGTERM), and its log windows are read."""
    monkeypatch.setattr(train_checks, "train_overrides", lambda mixer, run_dir: [
        *TINY, f"mixer={mixer}", "trainer.max_steps=100000", "trainer.eval_every=100000", "trainer.ckpt_every=100000",
        "trainer.sample_tokens=0", f"run_dir={run_dir}"])
    # room for a loaded machine: train.py's imports alone take 10 s on a quiet 2-core one, and a multi-process test
    # beside this one can double that
    stage = checks_stage.Stage("train", 62, cuda=True, mixers=["softmax"], device="cpu")
    t0 = time.perf_counter()
    stage.run([checks_stage.Check("train", train_checks.check_train, 60)])
    assert time.perf_counter() - t0 < 60
    (row,) = stage.rows
    assert row["ok"], row["problems"]
    assert row["windows"] >= 2 and row["steps"] < 100000 and row["tokens_per_sec"] > 0 and row["slot_s"] <= 57


def test_mismatch_within_and_beyond_tolerance():
    want = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    assert checks_stage.mismatch("x", want.clone(), want, 1e-3) is None
    assert checks_stage.mismatch("x", want + 3e-3, want, 1e-3) is None  # 3e-3 <= 1e-3 * max |want| = 4e-3
    line = checks_stage.mismatch("gdn o", want + 1e-2, want, 1e-3)
    assert line.startswith("MISMATCH gdn o:") and "0.01" in line and "tolerance 0.001" in line


def test_mismatch_shape_nonfinite_and_zero_reference():
    want = torch.zeros(3)
    assert "shape (2,), expected (3,)" in checks_stage.mismatch("s", torch.zeros(2), want, 1e-3)
    assert "1 non-finite" in checks_stage.mismatch("n", torch.tensor([0.0, float("nan"), 0.0]), want, 1e-3)
    assert checks_stage.mismatch("z", torch.zeros(3), want, 1e-3) is None
    assert "inf of max |want| = 0" in checks_stage.mismatch("z", torch.tensor([0.0, 1e-6, 0.0]), want, 1e-3)
    assert checks_stage.scalar_mismatch("loss", 6.01, 6.0, 1e-2) is None
    assert checks_stage.scalar_mismatch("loss", 6.1, 6.0, 1e-2).startswith("MISMATCH loss:")


def test_norm_mismatch_tolerates_a_few_values_off():
    want = torch.ones(100)
    few = want.clone()
    few[:2] = 1.3  # two values 30% off: ||diff|| / ||want|| = 0.042
    assert checks_stage.norm_mismatch("l", few, want, 5e-2) is None
    assert checks_stage.mismatch("l", few, want, 5e-2) is not None
    assert "is 0.1 of ||want||" in checks_stage.norm_mismatch("l", want * 1.1, want, 5e-2)


def test_counting_counts_calls_and_restores():
    import model.ops.ssd.recurrent as ssd

    original = ssd.mamba_state_step
    with checks_stage.counting("model.ops.ssd.recurrent", "mamba_state_step") as calls:
        x = fla_cases.ssd_inputs(T=1, P=2, N=3)
        ssd.mamba_state_step(x["x"][:, 0], x["dt"][:, 0], x["A"], x["B"][:, 0], x["C"][:, 0], x["initial_states"])
    assert calls == [1] and ssd.mamba_state_step is original


@pytest.fixture
def quiet_cpu_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(perf, "_cpu_peak_memo", {})
    monkeypatch.setattr(perf, "measure_cpu_peak", lambda: (100e9, 0.0))
    monkeypatch.setattr(kernels, "cpu_contention_warning", lambda: None)


def test_cpu_check_catches_a_wrong_path(quiet_cpu_peak, monkeypatch):
    stage = checks_stage.Stage("kernels", 60, cuda=False)
    stage.run([model_checks.KERNEL_CHECKS[0]])
    assert stage.problems() == [] and len(stage.rows) == 3
    right = kernels.op_gdn_recurrent

    def off_by_a_little(**inputs):
        out = right(**inputs)
        return {**out, "o": out["o"] * 1.01}

    monkeypatch.setattr(kernels, "op_gdn_recurrent", off_by_a_little)
    stage = checks_stage.Stage("kernels", 60, cuda=False)
    stage.run([model_checks.KERNEL_CHECKS[0]])
    lines = stage.problems()
    assert len(lines) == 1 and lines[0].startswith("MISMATCH cpu gdn chunk vs recurrent o:")
