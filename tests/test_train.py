"""End-to-end training runs (subprocesses, tiny sizes): train + eval + export, resume equals the
uninterrupted run, 2-process DDP equals 1 process with gradient accumulation, clean failures."""
import json
import shutil
import sys

import pytest
import torch

from conftest import ROOT, run_train
from training.metrics import read_metrics

KEYS = ["train/loss", "train/ppl", "lr", "grad_norm", "perf/tokens_per_sec", "perf/step_time", "perf/tflops",
        "perf/mfu", "perf/peak_mem_gb", "tokens_seen"]


def losses(run_dir):
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


def test_train_eval_export_and_evaluate(tmp_path, data_cache):
    run = tmp_path / "run"
    proc = run_train(run, cache=data_cache)
    rows = read_metrics(run)
    assert all(k in rows[0] for k in KEYS), rows[0]
    evals = [r for r in rows if "val/loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    assert evals[-1]["val/bpb"] > 0 and abs(evals[-1]["val/ppl"] - torch.tensor(evals[-1]["val/loss"]).exp().item()) < 1e-3
    l = losses(run)
    assert l[8] < l[1], l  # it learns
    assert "val loss" in proc.stdout and "bpb" in proc.stdout and "sample" in proc.stdout
    final = run / "final"
    assert {"config.json", "model.safetensors", "tokenizer.json", "training_config.yaml"} <= {p.name for p in final.iterdir()}
    assert len(list((run / "checkpoints").glob("step_*"))) == 1  # step 4 (the last step exports instead)
    assert not list(run.glob(".tmp*")) and not list((run / "checkpoints").glob(".tmp*"))

    import subprocess
    out = tmp_path / "eval"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "evaluate.py"), f"checkpoint={final}",
                           f"out_dir={out}", "batches=2", "batch_size=4", "sample_tokens=8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    # Same val split and model: evaluate.py reproduces train.py's final val loss.
    assert report["val/loss"] == pytest.approx(evals[-1]["val/loss"], abs=1e-4)
    assert (out / "per_position_loss.png").exists() and report["decode_tokens_per_sec"] > 0


@pytest.mark.parametrize("optimizer", [["optimizer=adamw"], ["optimizer=muon", "ffn=moe"]], ids=["adamw", "muon-moe"])
def test_resume_equals_uninterrupted(tmp_path, data_cache, optimizer):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_train(full, "trainer.keep_checkpoints=5", *optimizer, cache=data_cache)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step_0000004", resumed / "checkpoints" / "step_0000004")
    proc = run_train(resumed, "resume=auto", *optimizer, cache=data_cache)
    assert "resumed from" in proc.stdout
    if optimizer[0] == "optimizer=muon":  # the checkpoint holds Muon's momentum, per expert stack too
        saved = torch.load(resumed / "checkpoints" / "step_0000004" / "optimizer.bin", weights_only=True)
        muon_state, adamw_state = (part["state"].values() for part in saved["parts"])
        assert {s["momentum_buffer"].ndim for s in muon_state} == {2, 3}
        assert all("exp_avg_sq" in s for s in adamw_state)
    a, b = losses(full), losses(resumed)
    assert a[8] < a[1], a  # it learns: the schedule reaches every part of the optimizer
    assert sorted(b) == [5, 6, 7, 8]
    for step in b:
        assert b[step] == pytest.approx(a[step], abs=1e-6), (step, a, b)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_ddp_two_processes_equals_grad_accum(tmp_path, data_cache, optimizer):
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(one, "trainer.grad_accum=2", "trainer.max_steps=4", f"optimizer={optimizer}", cache=data_cache)
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml")]
    run_train(two, "trainer.max_steps=4", f"optimizer={optimizer}", launcher=launcher, cache=data_cache)
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-5), (a, b)
    assert (two / "final" / "model.safetensors").exists()


def test_non_finite_loss_stops_with_message(tmp_path, data_cache):
    proc = run_train(tmp_path / "nan", "trainer.lr=1e12", "trainer.grad_clip=1e30", "trainer.warmup_steps=0",
                     "trainer.max_steps=30", "trainer.ckpt_every=1", check=False, cache=data_cache)
    assert proc.returncode == 1
    msg = [l for l in proc.stdout.splitlines() if "non-finite" in l]
    assert msg and "at step" in msg[0] and "Last good checkpoint" in msg[0], proc.stdout[-2000:]
    assert not (tmp_path / "nan" / "final").exists()


@pytest.mark.parametrize("arg,needle,valid", [
    ("attention=nope", "unknown attention 'nope'; valid: ", "softmax"),
    ("ffn=dense,nope", "unknown ffn 'nope'; valid: ", "dense"),
    ("data=nope", "unknown data 'nope'; valid: ", "stdlib"),
    ("model=nope", "unknown model 'nope'; valid: ", "tiny"),
    ("optimizer=nope", "unknown optimizer 'nope'; valid: ", "adamw, muon"),
])
def test_unknown_group_choice_is_one_line(tmp_path, arg, needle, valid):
    import subprocess
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), arg], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and valid in lines[0], lines


@pytest.mark.parametrize("override,needle", [
    ("trainer.seq_len=8192", "exceeds model.max_position_embeddings=4096"),
    ("model.attention=[softmax,nope]", "unknown attention 'nope'; valid:"),
    ("data=local data.path=/nonexistent/x.txt", "does not exist"),
    ("trainer.batch_size=3 trainer.grad_accum=2", "is not divisible"),
])
def test_bad_values_fail_with_clear_message(tmp_path, data_cache, override, needle):
    proc = run_train(tmp_path / "bad", *override.split(), check=False, cache=data_cache)
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "bad" / "final").exists()


def test_sigterm_saves_a_checkpoint_and_resume_continues(tmp_path, data_cache):
    import os
    import signal
    import subprocess
    import time

    from conftest import TINY

    run = tmp_path / "sig"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SWAPLM_CACHE": str(data_cache)}
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, f"run_dir={run}", "trainer.max_steps=100000",
           "trainer.ckpt_every=100000", "trainer.eval_every=100000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").exists() and time.time() < deadline:  # the loop has started
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:]
    saved = [l for l in out.splitlines() if l.startswith("SIGTERM: saved")]
    assert saved and "resume=auto" in saved[0], out[-2000:]
    (ckpt,) = (run / "checkpoints").glob("step_*")
    step = int(ckpt.name.split("_")[1])
    proc = run_train(run, "resume=auto", f"trainer.max_steps={step + 2}", cache=data_cache)
    assert f"resumed from {ckpt} at step {step}" in proc.stdout
    assert sorted(losses(run))[-2:] == [step + 1, step + 2]
