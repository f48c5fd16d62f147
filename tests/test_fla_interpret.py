"""fla's Triton kernels on the CPU through Triton's interpreter, called by our ops' own dispatch exactly as
on CUDA (the same wrapper, the same arguments), against our PyTorch ops in float64: GDN chunk (with and
without cu_seqlens and initial states, gradients included) and fused recurrent (forward: fla has no
backward for it, and we decode with it), the same for DeltaNet (no decay: fla's GDN kernel at g = 0, as its
chunk_delta_rule refuses fp32; fused_recurrent_delta_rule to decode) and KDA (a decay per key channel: chunk_kda)
with beta in (0, 2) (allow_neg_eigval), GDN-2 (chunk_gdn2 and fused_recurrent_gdn2: erase gates per key channel in
(0, 2), write gates per value channel, gradients of both) and Gated DeltaProduct (two Householder steps per token,
fla's GDN kernels on the interleaved steps, as model/ops/gated_delta/product.py calls them), linear attention
(plain and with our normaliser, cu_seqlens), Mamba2's SSD through chunk_simple_gla (cu_seqlens, initial states,
gradients; with allow_neg_eigval too, its sign carried around the same kernel). A case the interpreter cannot
run is skipped with the worker's reason (bf16: the interpreter computes bf16 arithmetic on raw bits).

The kernels run in a subprocess (tests/fla_interpret_worker.py): TRITON_INTERPRET must be set before fla's
kernels are decorated at import and then turns every Triton kernel decorated after it into an interpreted
one, and the worker also patches the interpreter and imports fla (which registers its models with
transformers), so none of it may reach the other tests. This process never imports triton or fla.
"""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, once_per_session
from fla_interpret_worker import CASES

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ("triton", "fla")),
    reason="triton and flash-linear-attention are not installed (pip install -r requirements-test.txt)")]

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 5e-2}  # of max |reference|; the interpreter's fp32 dots are exact fp32
# With allow_neg_eigval, dt, A and dt_bias reach the scan's log|a_t| through 1/a_t (model/ops/ssd/chunk.py): their gradients
# carry its fp32 rounding times up to 1/min|a_t| (our own fp32 PyTorch path as much as fla's), so 10x the tolerance.
THROUGH_LOG_ABS = ("ddt", "dA", "ddt_bias")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    def produce(out):  # once per session: the cases are spread over the pytest-xdist workers
        env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "tests.fla_interpret_worker", str(out)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(once_per_session(tmp_path_factory, "fla_interpret.pt", produce))


@pytest.mark.parametrize("case", list(CASES))
def test_fla_kernel_matches_our_op(results, case):
    result = results[case]
    if "skip" in result:
        pytest.skip(f"Triton's interpreter cannot run it: {result['skip']}")
    assert "error" not in result, result["error"]
    assert (result["fla_calls"], result["ours_calls"]) == (1, 0)  # the dispatch called fla; the reference did not
    got, want = result["fla"], result["ours"]
    grads = CASES[case][2]
    assert got.keys() == want.keys() and {f"d{name}" for name in grads} <= want.keys()
    dtype = (*CASES[case], None, None)[6] or torch.float32
    signed = CASES[case][1].get("allow_neg_eigval", False)
    for key in want:
        assert got[key].shape == want[key].shape, (key, got[key].shape, want[key].shape)
        err, scale = (got[key] - want[key]).abs().max().item(), want[key].abs().max().item()
        tolerance = TOLERANCE[dtype] * (10 if signed and key in THROUGH_LOG_ABS else 1)
        assert err <= tolerance * scale, f"{case} {key}: max |fla - ours| = {err:.3g}, max |ours| = {scale:.3g}"
