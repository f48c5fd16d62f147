"""Expert parallelism (training/parallel.py, model/ffn/expert_parallel.py) on gloo processes: a MoE layer
split over 2 EP ranks equals the unsplit layer in float64 (outputs, input, router, shared and expert
gradients, the gradient norm) for every router, with 2 processes (EP 2) and with 4 (2 data replicas of
EP 2); each run asserts the world, EP and data-parallel sizes that ran. Training, resume across layouts
and the export: tests/test_distributed.py. Bad sizes are one line."""
import json
import subprocess

import pytest
import torch

from conftest import ROOT, ddp_launcher
from model import DecoderLM, LMConfig
from model.ffn.routers import ROUTERS
from training.parallel import apply_expert_parallel




@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_split_layer_equals_the_unsplit_layer(tmp_path, world):
    proc = subprocess.run([*ddp_launcher("--num_processes", str(world)), "-m", "tests.ep_worker", str(tmp_path), "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / f"ep2_world{world}.json").read_text())
    assert result["world_size"] == world and sorted(result["routers"]) == ROUTERS.names()
    for router, r in result["routers"].items():
        assert (r["ep_size"], r["dp_size"], r["local_experts"]) == (2, world // 2, 4), router
        assert r["worst"] < 1e-10, (router, r)
        assert "drouter.weight" in r or router == "hash"
        assert ("drouter.value" in r) == (router == "reinforce")  # the value head's gradient compared too


def moe_lm(num_experts=8, ffn="moe"):
    return DecoderLM(LMConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=32, ffn=ffn, ffn_options={"moe": {"num_experts": num_experts}}))


@pytest.mark.parametrize("size,world,lm,message", [
    (2, 3, moe_lm, "trainer.expert_parallel=2; valid: a divisor of the process count (3)"),
    (2, 2, lambda: moe_lm(ffn="dense"), "trainer.expert_parallel=2 needs MoE layers"),
    (4, 4, lambda: moe_lm(num_experts=6), "trainer.expert_parallel=4; valid: a divisor of ffn.options.num_experts=6"),
])
def test_sizes_that_do_not_fit_are_one_line(size, world, lm, message):
    with pytest.raises(ValueError) as e:
        apply_expert_parallel(lm(), size, world, "cpu")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_expert_parallel_1_changes_nothing():
    lm = moe_lm()
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    assert apply_expert_parallel(lm, 1, 2, "cpu") is None
    assert all(torch.equal(before[k], v) for k, v in lm.state_dict().items())
    assert not hasattr(lm, "_ddp_params_and_buffers_to_ignore")
