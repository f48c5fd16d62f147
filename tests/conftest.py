import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# pytest-xdist workers share the cores: each worker, and each process a test starts, gets its share of them
# (more threads would only contend; and a run inside a test and its reference in a subprocess then sum alike).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, (os.cpu_count() or 1) // WORKERS))
torch.set_num_threads(THREADS)
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))


def pytest_collection_modifyitems(items):
    """The slow tests first (the order is otherwise kept): pytest-xdist's workers start on the long runs and
    share out the many short tests after, rather than ending on a few long ones side by side."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One tokenizer/token cache for the whole session (a small BPE on 40 stdlib files), shared by the
    pytest-xdist workers (their temp folders share a parent; the store is built under a file lock, data/text.py)."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "swaplm_cache"
    path.mkdir(exist_ok=True)
    os.environ["SWAPLM_CACHE"] = str(path)
    return path


def once_per_session(tmp_path_factory, name: str, produce) -> Path:
    """The file `name` that produce(path) writes, made once per session however many pytest-xdist workers ask (the
    first under a file lock, the others wait and read it): for a module fixture whose tests are spread over the
    workers and that would otherwise run its long subprocess in each (tests/test_fla_interpret.py)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    with FileLock(f"{path}.lock"):
        if not path.exists():
            produce(path)
    return path


def free_port() -> int:
    """A TCP port nothing listens on now: each distributed launch gets its own, so that launches of
    tests running side by side (pytest-xdist) do not meet on one rendezvous port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_launcher(*options: str) -> list[str]:
    """`accelerate launch` of 2 gloo processes on CPU (configs/accelerate/cpu_ddp.yaml) on a free port."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml"), "--main_process_port", str(free_port()), *options]


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


def train_here(run_dir: Path, *overrides: str, cache: Path | None = None, base: list[str] = TINY) -> str:
    """train.py's run of base (TINY) + overrides inside this process, for tests whose subject is not the command line:
    the config composed and checked as train.py does (runs/config.py compose, train.py's checked_config),
    then the loop (training/loop.py train). Returns what it printed (also echoed to the test's captured
    stdout, so that a run that raises, SystemExit included, still shows it). Accelerate's state, the signal
    handlers and torch's thread count are put back after, as the next test would find them in a new process."""
    import contextlib
    import io
    import signal

    from accelerate.state import AcceleratorState

    from train import checked_config
    from runs.config import compose
    from training.loop import train

    overrides = [*base, f"run_dir={run_dir}", *overrides]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    threads, cache_before = torch.get_num_threads(), os.environ.get("SWAPLM_CACHE")
    if cache is not None:
        os.environ["SWAPLM_CACHE"] = str(cache)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            train(checked_config(compose(overrides), overrides))
    finally:
        sys.stdout.write(printed.getvalue())
        AcceleratorState._reset_state(reset_partial_state=True)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        torch.set_num_threads(threads)
        if cache_before is not None:
            os.environ["SWAPLM_CACHE"] = cache_before
    return printed.getvalue()


def perturbed(model):
    """The model in float64, every parameter moved off its init by 0.05 N(0, 1): a gate at its init can hide a
    missing term, which then shows."""
    model = model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


class FinishedJob:
    """A job that ran to its end before it was handed back: poll() and wait() give its exit code."""

    def __init__(self, returncode: int):
        self.returncode = returncode

    def poll(self) -> int:
        return self.returncode

    wait = poll


@pytest.fixture
def jobs_here(monkeypatch):
    """analysis.runner's train.py jobs (the study drivers') run in this process through train_here, one after
    another, each job's console in its log as a process would leave it: for tests whose subject is the driver
    (its grid, resume and tables), not train.py's process."""
    import contextlib
    import traceback

    import analysis.runner

    def start(cmd: list[str], log, env) -> FinishedJob:
        overrides = cmd[next(i for i, c in enumerate(cmd) if c.endswith("train.py")) + 1:]
        (run_dir,) = [o.split("=", 1)[1] for o in overrides if o.startswith("run_dir=")]
        overrides = [o for o in overrides if not o.startswith(("run_dir=", "hydra."))]
        with contextlib.redirect_stdout(log):
            try:
                train_here(Path(run_dir), *overrides, base=[])
            except SystemExit as e:
                log.write(f"{e.code}\n" if isinstance(e.code, str) else "")
                return FinishedJob(0 if e.code is None else e.code if isinstance(e.code, int) else 1)
            except Exception:
                traceback.print_exc(file=log)
                return FinishedJob(1)
        return FinishedJob(0)

    monkeypatch.setattr(analysis.runner, "start", start)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, data_cache) -> tuple[Path, str]:
    """One default run of TINY (softmax + dense, 8 steps, checkpoint at 4, final/ export), trained in this
    process, and what it printed: shared by the tests that check it and those that start from it."""
    run = tmp_path_factory.mktemp("tiny") / "run"
    return run, train_here(run, cache=data_cache)


ALTERNATION_ALPHABET = 16


def alternation(n: int, generator: torch.Generator, length: int = 32) -> torch.Tensor:
    """n sequences a b a b ... of two tokens drawn from the first 16: from the third position on, the
    next token is the one before the current one. A model that sees only the current token (no
    sequence mixing) cannot beat log(16) nats there; a mixer can copy it."""
    return torch.randint(0, ALTERNATION_ALPHABET, (n, 2), generator=generator).repeat(1, length // 2)


def train_on_alternation(model, steps: int = 30, lr: float = 2e-2) -> float:
    """AdamW steps on fresh alternation batches (16 x 32 tokens); returns the held-out loss at the
    positions only the context predicts (log(16) ~ 2.77 is the best without the mixer)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = alternation(16, g)
        loss = model(ids, labels=ids).loss
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    held_out = alternation(32, torch.Generator().manual_seed(99))
    with torch.no_grad():
        logits = model(held_out).logits[:, 1:-1]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), held_out[:, 2:].flatten()).item()


def reinitialised_over_nan(model):
    """Every parameter NaN, then the model's init again, as for weights from_pretrained did not load."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    for module in model.modules():
        module._is_hf_initialized = False
    model.initialize_weights()
    return model


BF16_UNIT = 2**-8  # bf16's unit roundoff (8 significant bits)


def assert_bf16_rounding_of(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out (bf16) is ref (float64) rounded once to bf16, as from an op that accumulates in fp32: every
    element within 2 units of roundoff, and the normwise relative error at most 0.6 of one (rounding
    once gives ~0.4; an op that also rounds its intermediates to bf16 gives ~1 or more)."""
    out = out.double()
    torch.testing.assert_close(out, ref, rtol=2 * BF16_UNIT, atol=1e-3 * ref.abs().max().item())
    err = ((out - ref).norm() / ref.norm()).item() / BF16_UNIT
    assert err <= 0.6, f"normwise relative error {err:.2f} units of bf16 roundoff (> 0.6)"
