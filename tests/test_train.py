"""End-to-end training runs (subprocesses, tiny sizes): train + eval + export, resume equals the
uninterrupted run, clean failures. Multi-process runs are in test_distributed.py."""
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
    proc = subprocess.run([sys.executable, "-m", "scripts.evaluate", f"checkpoint={final}",
                           f"out_dir={out}", "batches=2", "batch_size=4", "sample_tokens=8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    # Same val split and model: evaluate.py reproduces train.py's final val loss.
    assert report["val/loss"] == pytest.approx(evals[-1]["val/loss"], abs=1e-4)
    assert (out / "per_position_loss.png").exists() and report["decode_tokens_per_sec"] > 0

    # A mid-run checkpoint is evaluable as it is: evaluate.py reproduces the step-4 val loss from it.
    step4 = run / "checkpoints" / "step_0000004"
    proc = subprocess.run([sys.executable, "-m", "scripts.evaluate", f"checkpoint={step4}",
                           f"out_dir={tmp_path / 'eval4'}", "batches=2", "batch_size=4", "sample_tokens=0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "eval4" / "eval.json").read_text())
    assert report["val/loss"] == pytest.approx(evals[0]["val/loss"], abs=1e-4)
    from scripts.run_lm_eval import load
    lm, tokenizer = load(step4, "cpu")
    assert lm.config.vocab_size == len(tokenizer)


@pytest.mark.parametrize("optimizer", [["optimizer=adamw"], ["optimizer=muon", "ffn=moe"]], ids=["adamw", "muon-moe"])
def test_resume_equals_uninterrupted(tmp_path, data_cache, optimizer):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_train(full, "trainer.keep_checkpoints=5", *optimizer, cache=data_cache)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step_0000004", resumed / "checkpoints" / "step_0000004")
    proc = run_train(resumed, "resume=auto", *optimizer, cache=data_cache)
    assert "resumed from" in proc.stdout
    if optimizer[0] == "optimizer=muon":  # the checkpoint holds Muon's momentum, per expert stack too
        from torch.distributed.checkpoint import FileSystemReader
        saved = FileSystemReader(resumed / "checkpoints" / "step_0000004" / "state").read_metadata().state_dict_metadata
        assert {len(m.size) for k, m in saved.items() if k.endswith("momentum_buffer")} == {2, 3}
        assert any(k.endswith("embed_tokens.weight.exp_avg_sq") for k in saved)
    a, b = losses(full), losses(resumed)
    assert a[8] < a[1], a  # it learns: the schedule reaches every part of the optimizer
    assert sorted(b) == [5, 6, 7, 8]
    for step in b:
        assert b[step] == pytest.approx(a[step], abs=1e-6), (step, a, b)


def test_corrupt_checkpoint_falls_back_to_the_previous_good_one(tmp_path, data_cache):
    full, run = tmp_path / "full", tmp_path / "run"
    run_train(full, "trainer.ckpt_every=2", "trainer.keep_checkpoints=5", cache=data_cache)
    (run / "checkpoints").mkdir(parents=True)
    for step in (2, 4):
        shutil.copytree(full / "checkpoints" / f"step_000000{step}", run / "checkpoints" / f"step_000000{step}")
    shard = run / "checkpoints" / "step_0000006"
    shutil.copytree(full / "checkpoints" / "step_0000006", shard)
    bad = next((shard / "state").glob("*.distcp"))
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])  # a write cut short
    proc = run_train(run, "trainer.ckpt_every=2", "resume=auto", cache=data_cache)
    warning = [l for l in proc.stdout.splitlines() if "unusable" in l]
    assert warning and str(bad) in warning[0] and "truncated" in warning[0], proc.stdout[-2000:]
    assert "resumed from" in proc.stdout and "step_0000004 at step 4" in proc.stdout
    a, b = losses(full), losses(run)
    assert sorted(b) == [5, 6, 7, 8]
    for step in b:
        assert b[step] == pytest.approx(a[step], abs=1e-6), (step, a, b)


def test_resumed_run_continues_its_wandb_run(tmp_path, data_cache):
    """Offline W&B: the run id is kept in the run dir and the resumed process logs to the same run
    (read back from the offline run folders wandb wrote)."""
    run = tmp_path / "run"
    env = {"WANDB_MODE": "offline"}
    run_train(run, "logger=wandb", "trainer.max_steps=4", "trainer.ckpt_every=2", cache=data_cache, env=env)
    run_train(run, "logger=wandb", "trainer.max_steps=6", "trainer.ckpt_every=2", "resume=auto", cache=data_cache, env=env)
    run_id = (run / "wandb_run_id").read_text().strip()
    folders = sorted((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith(f"-{run_id}") for f in folders), folders
    assert all((f / f"run-{run_id}.wandb").exists() for f in folders)


def test_streamed_hub_dataset_trains(tmp_path, data_cache):
    """data=hf with streaming: parquet shards in a folder stand in for the hub (no val split, so a
    share is held out); train.py takes max_tokens from the stream and trains on the token store."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    hub = tmp_path / "hub" / "data"
    hub.mkdir(parents=True)
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * (3 + i % 4) for i in range(900)]
    for shard in range(3):
        pq.write_table(pa.table({"text": texts[shard::3]}), hub / f"train-0000{shard}-of-00003.parquet")
    run = tmp_path / "run"
    run_train(run, "data=hf", f"data.path={hub.parent}", "data.streaming=true", "data.max_tokens=20000",
              "data.val_fraction=0.1", "data.vocab_size=300", "data.max_documents=null", "trainer.max_steps=4",
              cache=data_cache)
    info = json.loads((run / "run_info.json").read_text())["data_info"]
    assert 20000 <= info["train_tokens"] + 64 and info["train_tokens"] < 21000 and info["val_documents"] > 0
    assert info["document_mask"] is True and len(losses(run)) == 4


def test_non_finite_loss_stops_with_message(tmp_path, data_cache):
    proc = run_train(tmp_path / "nan", "trainer.lr=1e12", "trainer.grad_clip=1e30", "trainer.warmup_steps=0",
                     "trainer.max_steps=30", "trainer.ckpt_every=1", check=False, cache=data_cache)
    assert proc.returncode == 1
    msg = [l for l in proc.stdout.splitlines() if "non-finite" in l]
    assert msg and "at step" in msg[0] and "Last good checkpoint" in msg[0], proc.stdout[-2000:]
    assert not (tmp_path / "nan" / "final").exists()


@pytest.mark.parametrize("arg,needle,valid", [
    ("attention=nope", "unknown attention 'nope'; valid: ", "softmax"),
    ("mixer=nope", "unknown mixer 'nope'; valid: ", "softmax"),
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
    ("model.attention=[softmax,nope]", "unknown mixer 'nope'; valid:"),
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
