import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One tokenizer/token cache for the whole session (a small BPE on 40 stdlib files)."""
    path = tmp_path_factory.mktemp("swaplm_cache")
    os.environ["SWAPLM_CACHE"] = str(path)
    return path


@pytest.fixture
def one_thread():
    """For tests of tiny shapes: a second thread only adds synchronisation, and is very slow when
    the cores are shared (use with pytestmark = pytest.mark.usefixtures("one_thread"))."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# A tiny run: 2 layers, d=64, a 512-token BPE on 40 stdlib files, 64-token sequences.
TINY = [
    "logger=none", "model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=4",
    "model.num_key_value_heads=2", "model.intermediate_size=128", "data.max_documents=40", "data.vocab_size=512",
    "trainer.seq_len=64", "trainer.batch_size=4", "trainer.max_steps=8", "trainer.warmup_steps=2",
    "trainer.log_every=1", "trainer.eval_every=4", "trainer.eval_batches=2", "trainer.ckpt_every=4",
    "trainer.sample_tokens=8",
]


def run_train(run_dir: Path, *overrides: str, launcher: list[str] | None = None, check: bool = True,
              cache: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if cache is not None:
        env["SWAPLM_CACHE"] = str(cache)
    cmd = (launcher or [sys.executable]) + [str(ROOT / "train.py"), *TINY, f"run_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def train_on_one_batch(model, steps: int = 8, vocab: int = 64) -> list[float]:
    """AdamW steps on one fixed random batch (4 x 32 tokens); returns the losses (a model that can
    learn drives them down)."""
    ids = torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


BF16_UNIT = 2**-8  # bf16's unit roundoff (8 significant bits)


def assert_bf16_rounding_of(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out (bf16) is ref (float64) rounded once to bf16, as from an op that accumulates in fp32: every
    element within 2 units of roundoff, and the normwise relative error at most 0.6 of one (rounding
    once gives ~0.4; an op that also rounds its intermediates to bf16 gives ~1 or more)."""
    out = out.double()
    torch.testing.assert_close(out, ref, rtol=2 * BF16_UNIT, atol=1e-3 * ref.abs().max().item())
    err = ((out - ref).norm() / ref.norm()).item() / BF16_UNIT
    assert err <= 0.6, f"normwise relative error {err:.2f} units of bf16 roundoff (> 0.6)"
