"""2-process DDP (gloo, `accelerate launch` as tests/test_distributed.py) equals 1 process with
gradient accumulation for every MoE router, through train.py's own train_step: the same losses, the
same aux metrics (the group and expert loads, the balance losses, unrouted_frac, token_choice_overlap, the REINFORCE
router's reward, baseline, temperature and share of sampled routes:
means over both processes' micro-batches, not rank 0's own) and the same final weights (router,
experts, the aux-free bias from loads and the REINFORCE token table from rewards all-reduced over ranks). Each launch trains every router
(tests/moe_routers_ddp_worker.py) and reports the process count that ran."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, ddp_launcher
from model.ffn.routers import ROUTERS




def launch(launcher: list[str], out, grad_accum: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([*launcher, "-m", "tests.moe_routers_ddp_worker", str(out), str(grad_accum)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(next(out.glob("world*.json")).read_text())


def assert_close(a, b, where: str):
    if isinstance(a, list):
        assert len(a) == len(b), where
        for x, y in zip(a, b):
            assert_close(x, y, where)
    else:
        assert b == pytest.approx(a, abs=1e-5), where


@pytest.mark.slow
def test_ddp_equals_accumulation_for_every_router(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = launch([sys.executable], tmp_path / "one", grad_accum=2)
    two = launch(ddp_launcher(), tmp_path / "two", grad_accum=1)
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert sorted(one["routers"]) == sorted(two["routers"]) == ROUTERS.names()  # every registered router ran
    for router, ref in one["routers"].items():
        got = two["routers"][router]
        for step, (a, b) in enumerate(zip(ref["steps"], got["steps"], strict=True)):
            assert sorted(a) == sorted(b), router
            assert "moe/layer0/group_load" in a and "moe/group_imbalance" in a
            for key in a:
                assert_close(a[key], b[key], f"{router} step {step + 1} {key}")
        for name, value in ref["weights"].items():
            assert_close(value, got["weights"][name], f"{router} {name}")
    topk = one["routers"]["topk"]
    assert any(topk["weights"]["expert_bias"])  # the aux-free bias moved
    assert one["routers"]["expert_choice"]["steps"][0]["moe/unrouted_frac"] > 0  # capacity 0.75 leaves tokens out
    reinforce = one["routers"]["reinforce"]  # sampled, seeded per token: the same draws either way
    assert reinforce["steps"][0]["moe/resampled_frac"] > 0 and any(reinforce["weights"]["router.reward_table"])
    assert [s["moe/temperature"] for s in reinforce["steps"]] == pytest.approx([2.0, 2 ** 0.5, 1.0])
    assert reinforce["weights"]["router.steps"] == 3 and any(reinforce["weights"]["expert_bias"])
