"""Multi-process training on CPU (gloo), each test asserting from the run's own output how many
processes ran: 2-process DDP equals 1 process with gradient accumulation (dense, and MoE + DSA),
DDP searches for unused parameters only where a block needs it, elastic resume (2 -> 1 and
1 -> 2 processes continue the same loss curve), and torch FSDP2's export and checkpoint round trip."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, run_train
from training.metrics import read_metrics

DDP = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
       str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml")]
MOE_DSA = ["attention=dsa", "model.attention=[dsa,softmax]", "ffn=moe", "ffn.options.aux_free_bias=true", "attention.options.topk=16"]
DSA_WARMUP = ["attention=dsa", "attention.options.stage=warmup", "attention.options.topk=16", "trainer.trainable=[indexer]"]


def losses(run_dir):
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


def run_info(run_dir):
    return json.loads((run_dir / "run_info.json").read_text())


def assert_same_losses(a: dict, b: dict, steps: list[int]):
    assert sorted(b) == steps, b
    for step in steps:
        assert b[step] == pytest.approx(a[step], abs=1e-5), (step, a, b)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_ddp_two_processes_equals_grad_accum_with_unused_search_off(tmp_path, data_cache, optimizer):
    """Muon too: every rank orthogonalises the same all-reduced gradient."""
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(one, "trainer.grad_accum=2", "trainer.max_steps=4", f"optimizer={optimizer}", cache=data_cache)
    run_train(two, "trainer.max_steps=4", f"optimizer={optimizer}", launcher=DDP, cache=data_cache)
    assert run_info(one)["processes"] == 1 and run_info(two)["processes"] == 2
    # A dense model: every parameter gets a gradient, so DDP runs without the unused-parameter search.
    assert run_info(two)["ddp_find_unused_parameters"] is False
    assert_same_losses(losses(one), losses(two), [1, 2, 3, 4])
    assert (two / "final" / "model.safetensors").exists()


def test_ddp_moe_dsa_equals_grad_accum_and_resumes_on_one_process(tmp_path, data_cache):
    """MoE with the aux-free bias (all-reduced load) + DSA's sparse stage: 2 processes give the
    losses and the final router bias of 1 process with accumulation; its step-4 checkpoint then
    resumes on 1 process and continues the same curve."""
    from safetensors.torch import load_file

    ref, two, resumed = tmp_path / "ref", tmp_path / "two", tmp_path / "resumed"
    run_train(ref, *MOE_DSA, "trainer.grad_accum=2", cache=data_cache)
    run_train(two, *MOE_DSA, "trainer.keep_checkpoints=5", launcher=DDP, cache=data_cache)
    info = run_info(two)
    assert info["processes"] == 2 and info["ddp_find_unused_parameters"] is True
    assert_same_losses(losses(ref), losses(two), list(range(1, 9)))
    bias = [k for k in load_file(ref / "final" / "model.safetensors") if "bias" in k and "ffn" in k]
    assert bias
    ref_w, two_w = load_file(ref / "final" / "model.safetensors"), load_file(two / "final" / "model.safetensors")
    for k in bias:
        assert ref_w[k].abs().sum() > 0 and torch.allclose(ref_w[k], two_w[k], atol=1e-6), k

    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(two / "checkpoints" / "step_0000004", resumed / "checkpoints" / "step_0000004")
    proc = run_train(resumed, *MOE_DSA, "trainer.grad_accum=2", "resume=auto", cache=data_cache)
    assert "saved by 2 process(es), now 1" in proc.stdout
    assert run_info(resumed)["processes"] == 1
    assert_same_losses(losses(ref), losses(resumed), [5, 6, 7, 8])


def test_dsa_warmup_checkpoint_of_one_process_resumes_on_two(tmp_path, data_cache):
    one, resumed = tmp_path / "one", tmp_path / "resumed"
    run_train(one, *DSA_WARMUP, "trainer.keep_checkpoints=5", cache=data_cache)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(one / "checkpoints" / "step_0000004", resumed / "checkpoints" / "step_0000004")
    proc = run_train(resumed, *DSA_WARMUP, "resume=auto", launcher=DDP, cache=data_cache)
    assert "saved by 1 process(es), now 2" in proc.stdout
    assert run_info(resumed)["processes"] == 2
    assert_same_losses(losses(one), losses(resumed), [5, 6, 7, 8])


def test_fsdp_export_and_checkpoint_round_trip(tmp_path):
    """torch FSDP2 (fully_shard) on 2 gloo processes: export_final gathers the shards into an HF dir
    whose model reproduces the sharded model's logits in one plain process; save_checkpoint writes
    one DCP shard per rank, and loading it into a freshly initialised sharded model + optimizer
    retrains the next step to the same loss and lr; the checkpoint dir itself loads with load_lm."""
    from training.checkpoint import load_lm

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29561", "-m", "tests.fsdp_worker", str(tmp_path)],
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
