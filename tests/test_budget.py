"""trainer.flops_budget / trainer.tokens_budget set a run's steps (training/budget.py): the arithmetic for
every mixer and for a MoE (active experts only), the run that uses it, the one-line errors; and every
job of a sweep (scripts/sweep.py, train.py -m) is checked before the first one starts (training/jobs.py)."""
import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, train_here
from model import MIXERS
from runs.config import compose, meta_model
from training.jobs import check_job

SMALL = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=4",
         "model.intermediate_size=128", "data.vocab_size=512", "trainer.seq_len=64", "trainer.batch_size=4",
         "trainer.warmup_steps=2"]
NO_STEPS = [o for o in TINY if not o.startswith("trainer.max_steps=")]


@pytest.mark.parametrize("ffn", ["dense", "moe"])
@pytest.mark.parametrize("mixer", MIXERS.names())
def test_flops_budget_buys_its_steps_to_a_step(mixer, ffn):
    """steps x tokens per step x training FLOPs per token == the budget, to half a step, for every mixer."""
    budget = 3.3e10
    overrides = [*SMALL, f"mixer={mixer}", f"ffn={ffn}", f"trainer.flops_budget={budget}"]
    cfg = compose(overrides)
    train_flops_per_token = 3 * check_job(cfg, overrides).flops_per_token(64, "cpu")  # every part trains
    per_step = 4 * 64 * train_flops_per_token
    assert cfg.trainer.max_steps == round(budget / per_step)
    assert abs(cfg.trainer.max_steps * per_step - budget) <= per_step / 2


def test_moe_budget_counts_active_experts_only():
    """A MoE's FLOPs per token grow with the experts a token runs through (top_k), not with how many exist."""
    def train_flops(*options):
        return 3 * meta_model(compose([*SMALL, "ffn=moe", "ffn.options.expert_intermediate_size=32", *options])
                              ).flops_per_token(64, "cpu")

    d, f, layers = 64, 32, 2
    e8, e16 = train_flops("ffn.options.num_experts=8"), train_flops("ffn.options.num_experts=16")
    assert e16 - e8 == 3 * layers * 2 * d * 8  # the router's extra logits only
    k1, k2 = train_flops("ffn.options.top_k=1"), train_flops("ffn.options.top_k=2")
    assert k2 - k1 == 3 * layers * 2 * 3 * d * f  # one more SwiGLU expert per token per layer


def test_tokens_budget():
    overrides = [*SMALL, "trainer.tokens_budget=25600"]
    cfg = compose(overrides)
    check_job(cfg, overrides)
    assert cfg.trainer.max_steps == 100  # 25,600 / (4 x 64)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.flops_budget=1e10", "trainer.max_steps=5"],
     "trainer.max_steps=5 and trainer.flops_budget=1e+10; valid: one of them (a budget sets the steps)"),
    (["trainer.flops_budget=1e10", "trainer.tokens_budget=1000"],
     "trainer.flops_budget=1e+10 and trainer.tokens_budget=1000; valid: one of them"),
    (["trainer.tokens_budget=100"], "trainer.tokens_budget=100 is under half a step (256 tokens per step); valid: >= 128"),
    (["trainer.max_steps=null"], "trainer.max_steps=null; valid: a positive integer, or null with trainer.flops_budget"),
    (["trainer.tokens_budget=256"], "trainer.warmup_steps=2; valid: <= trainer.max_steps=1"),  # checked once set
])
def test_budget_errors(overrides, message):
    overrides = [*SMALL, *overrides]
    with pytest.raises(ValueError) as e:
        check_job(compose(overrides), overrides)
    assert str(e.value).startswith(message)


@pytest.mark.slow
def test_a_budget_run_records_its_steps(tmp_path, data_cache):
    """A run with a budget prints what it set, trains that many steps, and saves both (a resume keeps them)."""
    budget = 2.6e9
    run = tmp_path / "run"
    out = train_here(run, "trainer.flops_budget=2.6e9", cache=data_cache, base=NO_STEPS)
    info = json.loads((run / "run_info.json").read_text())
    per_step = 4 * 64 * info["train_flops_per_token"]
    steps = round(budget / per_step)
    assert f"trainer.flops_budget=2.6e+09: {steps} steps x 256 tokens" in out
    assert info["max_steps"] == steps and info["train_flops"] == steps * per_step
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = max(rows, key=lambda r: r["step"])
    assert last["step"] == steps and last["flops_seen"] == steps * per_step  # the x-axis of an equal-compute plot
    saved = (run / "config.yaml").read_text()
    assert f"max_steps: {steps}" in saved and "flops_budget: 2600000000.0" in saved


def test_a_budget_with_max_steps_on_the_command_line_is_refused():
    """train.py's check of its config and overrides (TINY gives trainer.max_steps=8)."""
    from train import checked_config

    overrides = [*TINY, "trainer.tokens_budget=1e4"]
    with pytest.raises(ValueError, match=re.escape(
            "trainer.max_steps=8 and trainer.tokens_budget=10000; valid: one of them (a budget sets the steps)")):
        checked_config(compose(overrides), overrides)


@pytest.mark.slow
def test_train_multirun_checks_every_job_before_the_first(tmp_path):
    """A 2-job -m sweep whose second job is bad fails in one line, and no job starts (no sweep folder)."""
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *NO_STEPS, "trainer.max_steps=8,1",
           f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: job 1 of 2 (" + " ".join([*NO_STEPS, "trainer.max_steps=1", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
        + "): trainer.warmup_steps=2; valid: <= trainer.max_steps=1"]
    assert not (tmp_path / "sweep").exists()


def test_sweep_checks_every_job_before_the_first(tmp_path):
    from scripts import sweep

    with pytest.raises(SystemExit) as e:
        sweep.main([*NO_STEPS, "trainer.max_steps=8,1", "--launcher", "python", "--out", str(tmp_path / "sweep")])
    assert str(e.value) == "error: job 1_1: trainer.warmup_steps=2; valid: <= trainer.max_steps=1"
    assert not (tmp_path / "sweep").exists()
