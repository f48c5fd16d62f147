"""fla's own PyTorch references beside ours, for the delta-rule family's newest members: GDN-2
(fla.ops.gdn2.naive's naive_recurrent_gdn2 and naive_chunk_gdn2) against our naive_gated_delta, chunk_gated_delta_rule
and fused_recurrent_gated_delta_rule with the write gate; Gated DeltaProduct (fla.ops.gated_delta_product.naive's
naive_recurrent_gated_delta_product) against our naive_gated_delta_product, chunk_gated_delta_product and
fused_recurrent_gated_delta_product (2 and 3 Householder steps; also packed with cu_seqlens). Same inputs, an initial
state, final states and the gradients of a fixed random loss; T not a multiple of either chunk. Two independent
writings of the same recurrence agreeing says our oracles (and so our kernels' tests) hold fla's semantics: gate
layouts, where the decay and the erase gate apply, the step order within a token.

fla's references run in float32, ours in float64, in a subprocess (tests/fla_naive_worker.py): importing fla
registers its models with transformers and decorates its Triton kernels, which none of the other tests may see.
This process never imports fla.
"""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, once_per_session
from fla_naive_worker import CASES

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ("triton", "fla")),
    reason="triton and flash-linear-attention are not installed (pip install -r requirements-test.txt)")]

TOLERANCE = 1e-5  # of max |ours|: fla's references accumulate in float32 (we measure about 2e-7)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    def produce(out):  # once per session: the cases are spread over the pytest-xdist workers
        proc = subprocess.run([sys.executable, "-m", "tests.fla_naive_worker", str(out)], cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(once_per_session(tmp_path_factory, "fla_naive.pt", produce))


@pytest.mark.parametrize("case", list(CASES))
def test_fla_reference_matches_ours(results, case):
    result = results[case]
    assert "error" not in result, result["error"]
    got, want = result["fla"], result["ours"]
    grads = CASES[case][3]
    assert got.keys() == want.keys() == {"o", "state", *(f"d{name}" for name in grads)}
    for key in want:
        assert got[key].shape == want[key].shape, (key, got[key].shape, want[key].shape)
        err, scale = (got[key] - want[key]).abs().max().item(), want[key].abs().max().item()
        assert err <= TOLERANCE * scale, f"{case} {key}: max |fla - ours| = {err:.3g}, max |ours| = {scale:.3g}"
