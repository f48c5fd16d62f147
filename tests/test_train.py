"""End-to-end training runs (subprocesses, tiny sizes): train + eval + export, resume equals the
uninterrupted run, clean failures. Multi-process runs are in test_distributed.py."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, train_here
from runs.config import group_choices
from runs.metrics import read_metrics

KEYS = ["train/loss", "train/ppl", "lr", "grad_norm", "perf/tokens_per_sec", "perf/step_time", "perf/tflops",
        "perf/mfu", "perf/peak_mem_gb", "tokens_seen"]


def losses(run_dir):
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


@pytest.mark.slow
def test_train_eval_export_and_evaluate(tmp_path, tiny_run):
    run, stdout = tiny_run
    rows = read_metrics(run)
    assert all(k in rows[0] for k in KEYS), rows[0]
    evals = [r for r in rows if "val/loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    assert evals[-1]["val/bpb"] > 0 and abs(evals[-1]["val/ppl"] - torch.tensor(evals[-1]["val/loss"]).exp().item()) < 1e-3
    l = losses(run)
    assert l[8] < l[1], l  # it learns
    assert "val loss" in stdout and "bpb" in stdout and "sample" in stdout
    final = run / "final"
    assert {"config.json", "model.safetensors", "tokenizer.json", "training_config.yaml"} <= {p.name for p in final.iterdir()}
    assert len(list((run / "checkpoints").glob("step_*"))) == 1  # step 4 (the last step exports instead)
    assert not list(run.glob(".tmp*")) and not list((run / "checkpoints").glob(".tmp*"))

    # the export as docs/configuration.md loads it: prompts padded on the left into one greedy generate, each row
    # the text its prompt gives alone
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm, tok = AutoModelForCausalLM.from_pretrained(final), AutoTokenizer.from_pretrained(final)
    prompts = ["a", "a much longer prompt"]
    inputs = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    assert not bool(inputs["attention_mask"].all())
    batch = lm.generate(**inputs, max_new_tokens=16, do_sample=False)[:, inputs["input_ids"].shape[1]:]
    for row, prompt in zip(batch, prompts):
        alone = tok(prompt, return_tensors="pt")
        one = lm.generate(**alone, max_new_tokens=16, do_sample=False)[0, alone["input_ids"].shape[1]:]
        assert tok.decode(row, skip_special_tokens=True) == tok.decode(one, skip_special_tokens=True), prompt

    out = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "eval.py", f"checkpoint={run}", f"out_dir={out}", "batches=2",
                           "batch_size=4", "sample_tokens=8", "num_samples=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    # Same val split and model: eval.py reproduces train.py's final val loss, on as many tokens.
    assert report["checkpoint"] == str(final)
    assert report["scores"]["val/loss"] == pytest.approx(evals[-1]["val/loss"], abs=1e-4)
    assert report["scores"]["val/tokens"] == evals[-1]["val/tokens"]
    assert (out / "per_position_loss.png").exists() and report["scores"]["decode_tokens_per_sec"] > 0
    assert len(report["per_position_loss"]) == 63 and len(report["samples"]) == 1
    assert "no W&B run to log into" in proc.stdout

    # A mid-run checkpoint is evaluable as it is: eval.py's evaluation (here in this process) reproduces the
    # step-4 val loss from it.
    from test_contract_suites import eval_config

    from eval import evaluate_checkpoint

    step4 = run / "checkpoints" / "step_0000004"
    evaluate_checkpoint(eval_config([f"checkpoint={step4}", "batches=2", "batch_size=4", "sample_tokens=0"]))
    report = json.loads((step4 / "eval" / "eval.json").read_text())
    assert report["scores"]["val/loss"] == pytest.approx(evals[0]["val/loss"], abs=1e-4)


@pytest.mark.slow
def test_resume_restores_the_run_past_a_corrupt_checkpoint(tmp_path, data_cache):
    """A gdn + MoE run under Muon (router=reinforce, whose sampling and reward baseline must continue as
    they were), resumed with nothing but `run_dir=R resume=auto` (as the stop message says): the saved config.yaml builds the same model, optimizer and data, the truncated last checkpoint
    is reported and skipped, and the losses continue exactly as the uninterrupted run's. Then
    resume=<run>/checkpoints/step_4 in a new run_dir while step 6 is the run's latest: that run's
    config is read, and steps 5..8 repeat the uninterrupted run's losses again."""
    run_args = ("mixer=gdn", "ffn=moe", "ffn.options.router=reinforce", "ffn.options.router_options.baseline=value",
                "optimizer=muon", "trainer.ckpt_every=2", "trainer.keep_checkpoints=5")
    full, run = tmp_path / "full", tmp_path / "run"
    train_here(full, *run_args, cache=data_cache)
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "config.yaml", run / "config.yaml")
    for step in (2, 4, 6):
        shutil.copytree(full / "checkpoints" / f"step_000000{step}", run / "checkpoints" / f"step_000000{step}")
    from torch.distributed.checkpoint import FileSystemReader
    saved = FileSystemReader(run / "checkpoints" / "step_0000004" / "state").read_metadata().state_dict_metadata
    assert {len(m.size) for k, m in saved.items() if k.endswith("momentum_buffer")} == {2, 3}  # Muon's, per expert too
    bad = next((run / "checkpoints" / "step_0000006" / "state").glob("*.distcp"))
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])  # a write cut short
    env = {**os.environ, "SWAPLM_CACHE": str(data_cache)}
    proc = subprocess.run([sys.executable, "train.py", f"run_dir={run}", "resume=auto"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    warning = [l for l in proc.stdout.splitlines() if "unusable" in l]
    assert warning and str(bad) in warning[0] and "truncated" in warning[0], proc.stdout[-2000:]
    assert "resumed from" in proc.stdout and "step_0000004 at step 4" in proc.stdout
    assert "layers ['gdn', 'gdn'] x ['moe', 'moe']" in proc.stdout
    a = losses(full)
    assert a[8] < a[1], a  # it learns
    step4 = full / "checkpoints" / "step_0000004"
    assert f"resumed from {step4} at step 4" in train_here(tmp_path / "again", f"resume={step4}", cache=data_cache)
    for b in (losses(run), losses(tmp_path / "again")):
        assert sorted(b) == [5, 6, 7, 8]
        for step in b:
            assert b[step] == pytest.approx(a[step], abs=1e-6), (step, a, b)
    # the command may not change the model: one line naming the key and both values (train.py's check)
    from train import checked_config
    from runs.config import compose

    overrides = [f"run_dir={run}", "resume=auto", "mixer=softmax"]
    with pytest.raises(ValueError, match="^" + re.escape(
            f"resume: mixer.name was 'gdn' in {run / 'config.yaml'}, the command gives 'softmax'")):
        checked_config(compose(overrides), overrides)


@pytest.mark.slow
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
    train_here(run, "data=hf", f"data.path={hub.parent}", "data.streaming=true", "data.max_tokens=20000",
              "data.val_fraction=0.1", "data.vocab_size=300", "data.max_documents=null", "trainer.max_steps=4",
              cache=data_cache)
    info = json.loads((run / "run_info.json").read_text())["data_info"]
    assert 20000 <= info["train_tokens"] + 64 and info["train_tokens"] < 21000 and info["val_documents"] > 0
    assert info["document_mask"] is True and len(losses(run)) == 4


@pytest.mark.slow
def test_non_finite_loss_stops_with_message(tmp_path, data_cache, capsys):
    with pytest.raises(SystemExit) as e:
        train_here(tmp_path / "nan", "trainer.lr=1e12", "trainer.grad_clip=1e30", "trainer.warmup_steps=0",
                   "trainer.max_steps=30", "trainer.ckpt_every=1", cache=data_cache)
    assert e.value.code == 1
    out = capsys.readouterr().out
    msg = [l for l in out.splitlines() if "non-finite" in l]
    assert msg and "at step" in msg[0], out[-2000:]
    step = int(msg[0].split("at step ")[1].split(";")[0])
    named = msg[0].split("Last good checkpoint: ")[1].strip()
    assert named == str(tmp_path / "nan" / "checkpoints" / f"step_{step - 1:07d}"), msg[0]
    assert (tmp_path / "nan" / "checkpoints" / f"step_{step - 1:07d}" / "manifest.json").exists()
    assert not (tmp_path / "nan" / "final").exists()


@pytest.mark.parametrize("arg,needle,valid", [
    ("mixer=nope", "unknown mixer 'nope'; valid: ", "softmax"),
    ("ffn=dense,nope", "unknown ffn 'nope'; valid: ", "dense"),
    ("data=nope", "unknown data 'nope'; valid: ", "stdlib"),
    ("model=nope", "unknown model 'nope'; valid: ", "tiny"),
    ("optimizer=nope", "unknown optimizer 'nope'; valid: ", "adamw, muon"),
])
def test_unknown_group_choice_is_one_line(arg, needle, valid):
    from runs.config import check_group_overrides

    with pytest.raises(SystemExit) as e:
        check_group_overrides([arg])
    assert needle in str(e.value) and valid in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_train_py_prints_an_unknown_choice_as_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "mixer=nope"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [f"error: unknown mixer 'nope'; valid: {', '.join(group_choices('mixer'))}"]


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_printed_command_resumes_it(tmp_path, data_cache):
    """SIGTERM mid-run saves a checkpoint; the command the message prints, followed as printed (plus a
    step budget), continues with the restored weights and optimizer: its steps equal an uninterrupted
    run's (a constant lr, so the step budget does not change the schedule); and it logs to the same
    (offline) W&B run, whose id the run dir keeps."""
    import re
    import shlex
    import signal
    import time

    from conftest import TINY

    run = tmp_path / "sig"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SWAPLM_CACHE": str(data_cache), "WANDB_MODE": "offline"}
    constant = ["trainer.schedule=constant", "trainer.warmup_steps=0"]
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, "logger=wandb", *constant, f"run_dir={run}", "trainer.max_steps=100000",
           "trainer.ckpt_every=100000", "trainer.eval_every=100000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while len(losses(run)) < 2 and time.time() < deadline:  # the loop has run a step or two
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:]
    saved = [l for l in out.splitlines() if l.startswith("SIGTERM: saved")]
    assert saved, out[-2000:]
    printed = re.search(r"continue with `([^`]*)`", saved[0]).group(1)
    assert printed == f"python train.py run_dir={run} resume=auto"
    (ckpt,) = (run / "checkpoints").glob("step_*")
    step = int(ckpt.name.split("_")[1])
    proc = subprocess.run([sys.executable, *shlex.split(printed)[1:], f"trainer.max_steps={step + 2}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"resumed from {ckpt} at step {step}" in proc.stdout
    reference = tmp_path / "reference"
    train_here(reference, *constant, f"trainer.max_steps={step + 2}", "trainer.sample_tokens=0", cache=data_cache)
    a, b = losses(reference), losses(run)
    for s in (step + 1, step + 2):
        assert b[s] == pytest.approx(a[s], abs=1e-6), (s, a, b)
    run_id = (run / "wandb_run_id").read_text().strip()
    folders = sorted((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all((f / f"run-{run_id}.wandb").exists() for f in folders), folders


def halted(proc: subprocess.Popen, seen, timeout: float = 300) -> object:
    """Polls (every ms) until seen() returns something, then SIGSTOPs the launch's whole process group and asks
    seen() again: if it still holds, what the stopped processes left is what the SIGKILL that follows interrupts,
    and that is returned; if the run moved on meanwhile, it continues (SIGCONT) and the polling too. None where
    the run ended first."""
    import signal
    import time

    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        if seen():
            os.killpg(proc.pid, signal.SIGSTOP)
            if caught := seen():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return caught
            os.killpg(proc.pid, signal.SIGCONT)
        time.sleep(0.001)
    return None


@pytest.mark.slow
def test_sigkill_at_any_moment_loses_only_the_steps_since_the_last_checkpoint(tmp_path, data_cache):
    """A run SIGKILLed on one process before its first step, started again with resume=auto (no checkpoint: from
    step 0) and SIGKILLed while writing a checkpoint (its temp folder half-written), resumed on 2 gloo processes
    and SIGKILLed mid-step past its last checkpoint (a row logged that the next resume logs again), then resumed on
    one process to the end: each step logged once, every loss the uninterrupted run's."""
    from conftest import TINY, ddp_launcher, run_train

    short = ["trainer.max_steps=8", "trainer.ckpt_every=2", "trainer.eval_every=4", "trainer.sample_tokens=0"]
    reference, run = tmp_path / "reference", tmp_path / "run"
    train_here(reference, *short, cache=data_cache)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SWAPLM_CACHE": str(data_cache)}

    def launch(launcher: list[str], *overrides: str) -> subprocess.Popen:
        return subprocess.Popen([*launcher, str(ROOT / "train.py"), *TINY, *short, f"run_dir={run}", *overrides],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # its own process group: the kill reaches every rank

    def writing() -> list[str]:  # checkpoints being written: a temp folder not yet renamed into place
        folder = run / "checkpoints"
        return [p.name for p in folder.glob(".tmp_step_*")] if folder.is_dir() else []

    def set_up() -> bool:  # the run dir written (set up done), no step logged yet
        return (run / "config.yaml").exists() and not losses(run)

    assert halted(launch([sys.executable]), set_up)
    partial = halted(launch([sys.executable], "resume=auto"), writing)
    assert partial and not (run / "checkpoints" / partial[0].removeprefix(".tmp_")).exists(), partial
    done = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    last = int(done[-1].split("_")[1]) if done else 0

    def past_checkpoint() -> int | None:  # a step logged past the last checkpoint, whose own is not saved
        steps = [s for s in losses(run) if s > last + 1]
        return steps[-1] if steps and not (run / "checkpoints" / f"step_{steps[-1]:07d}").exists() else None

    proc = launch(ddp_launcher(), "resume=auto")
    interrupted = halted(proc, past_checkpoint)
    assert interrupted is not None and interrupted < 8, interrupted
    run_train(run, *short, "resume=auto", cache=data_cache)

    logged = [r["step"] for r in read_metrics(run) if "train/loss" in r]
    assert logged == list(range(1, 9)), logged  # the killed runs' steps past their checkpoints, logged again once
    want, got = losses(reference), losses(run)
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-5), (step, want, got)
    assert not list(run.glob(".tmp*")) and not list((run / "checkpoints").glob(".tmp*"))
