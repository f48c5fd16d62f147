"""Multi-process training on CPU (gloo), each test asserting from the run's own output how many
processes ran: 2-process DDP equals 1 process with gradient accumulation (dense AdamW, and MoE + DSA
under Muon with the experts split over the processes) in its train losses and in its val metrics (the same val tokens scored, the same loss and
aux metrics), DDP searches for unused parameters only where a block needs it, elastic resume (2 -> 1
and 1 -> 2 processes continue the same run: its losses, val metrics and, where the LM loss cannot
tell, the trained weights), and torch FSDP2's export and checkpoint round trip."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT, ddp_launcher, free_port, run_train, train_here
from runs.metrics import read_metrics

pytestmark = pytest.mark.slow


MOE_DSA = ["mixer=dsa", "model.mixer=[dsa,softmax]", "ffn=moe", "ffn.options.aux_free_bias=true", "mixer.options.topk=16"]
DSA_WARMUP = ["mixer=dsa", "mixer.options.stage=warmup", "mixer.options.topk=16", "trainer.trainable=[indexer]"]
VAL_TOKENS = 2 * 4 * 63  # conftest.TINY: eval_batches x batch_size sequences of seq_len 64, 63 targets each


def losses(run_dir):
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


def val_metrics(run_dir):
    rows = [r for r in read_metrics(run_dir) if "val/loss" in r]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("val/")} for r in rows}


def run_info(run_dir):
    return json.loads((run_dir / "run_info.json").read_text())


def assert_same_losses(a: dict, b: dict, steps: list[int]):
    assert sorted(b) == steps, b
    for step in steps:
        assert b[step] == pytest.approx(a[step], abs=1e-5), (step, a, b)


def assert_same_val(a: dict, b: dict, steps: list[int]):
    """The same val sequences scored (val/tokens, the whole eval_batches x batch_size of them) to the same
    loss and aux metrics (e.g. the DSA indexer's recall, reduced over the ranks)."""
    assert sorted(b) == steps, b
    for step in steps:
        assert a[step]["val/tokens"] == b[step]["val/tokens"] == VAL_TOKENS, (step, a[step], b[step])
        assert a[step].keys() == b[step].keys(), (step, a[step], b[step])
        for k, v in a[step].items():
            assert b[step][k] == pytest.approx(v, rel=1e-4, abs=1e-9), (step, k, a[step], b[step])


def test_ddp_two_processes_equals_grad_accum_with_unused_search_off(tmp_path, data_cache):
    """Dense AdamW (Muon under DDP: the MoE + DSA test below)."""
    one, two = tmp_path / "one", tmp_path / "two"
    train_here(one, "trainer.grad_accum=2", "trainer.max_steps=4", "optimizer=adamw", cache=data_cache)
    run_train(two, "trainer.max_steps=4", "optimizer=adamw", launcher=ddp_launcher(), cache=data_cache)
    assert run_info(one)["processes"] == 1 and run_info(two)["processes"] == 2
    # A dense model: every parameter gets a gradient, so DDP runs without the unused-parameter search.
    assert run_info(two)["ddp_find_unused_parameters"] is False
    assert_same_losses(losses(one), losses(two), [1, 2, 3, 4])
    assert_same_val(val_metrics(one), val_metrics(two), [4])
    assert (two / "final" / "model.safetensors").exists()


def test_ddp_moe_dsa_expert_parallel_equals_grad_accum_and_resumes_across_layouts(tmp_path, data_cache):
    """MoE with the aux-free bias (all-reduced load) + DSA's sparse stage, under Muon (the default;
    every rank orthogonalises the same all-reduced gradient), its experts split over the 2 processes
    (trainer.expert_parallel=2): the losses, val metrics and exported weights and logits of 1 process
    with accumulation; its step-4 checkpoint resumes on 1 process (EP 2 -> 1), and the 1-process run's
    on 2 with EP 2 (1 -> 2), each continuing the same curve."""
    from safetensors.torch import load_file

    from runs.checkpoint import load_lm

    ref, two, resumed, split = tmp_path / "ref", tmp_path / "two", tmp_path / "resumed", tmp_path / "split"
    train_here(ref, *MOE_DSA, "trainer.grad_accum=2", "trainer.keep_checkpoints=5", cache=data_cache)
    run_train(two, *MOE_DSA, "trainer.expert_parallel=2", "trainer.keep_checkpoints=5", launcher=ddp_launcher(), cache=data_cache)
    info = run_info(two)
    assert info["processes"] == 2 and info["expert_parallel"] == 2 and info["ddp_find_unused_parameters"] is True
    assert info["params"] == run_info(ref)["params"]  # counted before the experts were split
    assert OmegaConf.load(two / "config.yaml").optimizer.name == "muon"
    assert_same_losses(losses(ref), losses(two), list(range(1, 9)))
    assert_same_val(val_metrics(ref), val_metrics(two), [4, 8])
    assert "val/dsa/topk_attention_recall" in val_metrics(two)[8]
    # the exchange's telemetry: the mean rank sends as many rows as it receives, 4 bytes x d=64 each,
    # dispatch and combine, forward and backward
    rows = [r for r in read_metrics(two) if "ep/a2a_bytes" in r]
    assert len(rows) == 8 and all(r["ep/rows_sent"] > 0 and r["ep/a2a_seconds"] > 0 for r in rows)
    assert all(r["ep/a2a_bytes"] == pytest.approx(4 * 4 * 64 * r["ep/rows_sent"]) and r["ep/received_imbalance"] >= 1
               for r in rows)
    # the export gathers every expert: the same weights, bias included, and the same logits
    ref_w, two_w = load_file(ref / "final" / "model.safetensors"), load_file(two / "final" / "model.safetensors")
    assert ref_w.keys() == two_w.keys() and two_w["layers.0.ffn.gate_up_proj"].shape[0] == 8
    for k in ref_w:
        assert torch.allclose(ref_w[k], two_w[k], atol=1e-5), k
    assert any("bias" in k and "ffn" in k and ref_w[k].abs().sum() > 0 for k in ref_w)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [load_lm(r).eval()(ids).logits for r in (ref, two)]
    assert torch.allclose(logits[0], logits[1], atol=1e-4)

    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(two / "checkpoints" / "step_0000004", resumed / "checkpoints" / "step_0000004")
    assert "saved by 2 process(es), now 1" in train_here(resumed, *MOE_DSA, "trainer.grad_accum=2", "resume=auto",
                                                         cache=data_cache)
    assert run_info(resumed)["processes"] == 1 and run_info(resumed)["expert_parallel"] == 1
    assert_same_losses(losses(ref), losses(resumed), [5, 6, 7, 8])
    assert_same_val(val_metrics(ref), val_metrics(resumed), [8])

    (split / "checkpoints").mkdir(parents=True)
    shutil.copytree(ref / "checkpoints" / "step_0000004", split / "checkpoints" / "step_0000004")
    proc = run_train(split, *MOE_DSA, "trainer.expert_parallel=2", "resume=auto", launcher=ddp_launcher(), cache=data_cache)
    assert "saved by 1 process(es), now 2" in proc.stdout and run_info(split)["expert_parallel"] == 2
    assert_same_losses(losses(ref), losses(split), [5, 6, 7, 8])
    assert_same_val(val_metrics(ref), val_metrics(split), [8])


def test_dsa_warmup_checkpoint_of_one_process_resumes_on_two(tmp_path, data_cache):
    """In the warm-up stage only the indexer trains and the LM loss does not depend on it, so the
    restored state shows in the indexer: its final weights (which also depend on the restored
    optimizer state) and its val KL / recall equal the uninterrupted 1-process run's."""
    from safetensors.torch import load_file

    one, resumed = tmp_path / "one", tmp_path / "resumed"
    train_here(one, *DSA_WARMUP, "trainer.keep_checkpoints=5", cache=data_cache)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(one / "checkpoints" / "step_0000004", resumed / "checkpoints" / "step_0000004")
    proc = run_train(resumed, *DSA_WARMUP, "resume=auto", launcher=ddp_launcher(), cache=data_cache)
    assert "saved by 1 process(es), now 2" in proc.stdout
    assert run_info(resumed)["processes"] == 2
    assert_same_losses(losses(one), losses(resumed), [5, 6, 7, 8])
    assert_same_val(val_metrics(one), val_metrics(resumed), [8])
    want, got = load_file(one / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    indexer = [k for k in want if ".indexer." in k]
    assert indexer
    for k in indexer:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=k)


def test_fsdp_export_and_checkpoint_round_trip(tmp_path):
    """torch FSDP2 (fully_shard) on 2 gloo processes: export_final gathers the shards into an HF dir
    whose model reproduces the sharded model's logits in one plain process; save_checkpoint writes
    one DCP shard per rank, and loading it into a freshly initialised sharded model + optimizer
    retrains the next step to the same loss and lr; the checkpoint dir itself loads with load_lm."""
    from runs.checkpoint import load_lm

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), "-m", "tests.fsdp_worker", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2 and result["shard_files"] == ["__0_0.distcp", "__1_0.distcp"]
    assert result["checkpoint_problem"] is None and result["resumed_step"] == 2
    assert result["third_after_resume"] == pytest.approx(result["third"], abs=1e-6)
    assert result["lr_after_resume"] == pytest.approx(result["lr"])

    probe = torch.arange(16).view(1, 16) % 128
    expected = torch.tensor(result["probe_logits"])
    for folder in (tmp_path / "final", tmp_path / "checkpoints" / "step_0000002"):
        with torch.no_grad():
            logits = load_lm(folder)(probe).logits[0, :, :8]
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5, msg=str(folder))
