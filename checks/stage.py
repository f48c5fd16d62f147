"""The self-check's machinery: checks run case by case under their own deadlines into a Stage's rows (an exception
or an overrun is that case's or check's failure, never the others'), the summary table, and the comparisons that
turn a result into mismatch lines."""
import math
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from runs.config import group_choices

MIXERS = group_choices("mixer")
FWD_TOL, GRAD_TOL = 5e-3, 2e-2  # fp32, of max |reference|: Triton's fp32 dots run in tf32
BF16_FWD_TOL, BF16_GRAD_TOL = 3e-2, 6e-2  # bf16 inputs and intermediates (the reference gets the same bf16 inputs)


class DeadlineExceeded(BaseException):
    """A check's deadline passed (a BaseException, so no `except Exception` inside a check catches it)."""


@contextmanager
def deadline(seconds: float):
    """Raises DeadlineExceeded in the main thread `seconds` from now (SIGALRM, between Python bytecodes)."""
    def alarm(signum, frame):
        raise DeadlineExceeded

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Check:
    name: str
    run: Callable[["Stage"], None]
    deadline_s: float
    needs_cuda: bool = True


class Stage:
    """Runs checks and keeps one row per case: {check, case, ok, problems, seconds} (+ measurements);
    `mixers` are the ones stage train trains, `plan` what check_plan found for each. `device`: where the
    CUDA checks put their tensors (tests/test_gpu_check.py runs some on "cpu" to exercise their code)."""

    def __init__(self, name: str, budget_s: float, cuda: bool, mixers: list[str] = MIXERS, device: str = "cuda"):
        self.name, self.budget_s, self.cuda, self.mixers, self.device = name, budget_s, cuda, mixers, device
        self.rows: list[dict] = []
        self.plan: dict[str, dict] = {}
        self.check, self.check_ends = "", math.inf
        self.t_start = time.perf_counter()

    def time_left(self) -> float:
        """Seconds until the running check's deadline."""
        return self.check_ends - time.perf_counter()

    def record(self, case: str, problems: list[str], seconds: float, **measured) -> None:
        self.rows.append({"check": self.check, "case": case, "ok": not problems, "problems": problems,
                          "seconds": round(seconds, 2), **measured})
        status = "ok" if not problems else f"{len(problems)} mismatch(es)"
        print(f"  {case}: {status} ({seconds:.1f} s)", flush=True)

    def case(self, name: str, fn: Callable[[], list[str | None] | None]) -> None:
        """Runs one case: fn returns its mismatch lines (None entries ignored); an exception is a mismatch."""
        t0 = time.perf_counter()
        try:
            problems = [line for line in (fn() or []) if line]
        except Exception as e:  # one failing case must not hide the others
            problems = [f"MISMATCH {self.check} {name}: raised {type(e).__name__}: {first_line(e)}"]
        self.record(name, problems, time.perf_counter() - t0)

    def run(self, checks: list[Check]) -> None:
        for check in checks:
            self.check = check.name
            if check.needs_cuda and not self.cuda:
                continue
            print(f"[{check.name}] deadline {check.deadline_s:g} s", flush=True)
            t0, before = time.perf_counter(), len(self.rows)
            self.check_ends = t0 + check.deadline_s
            try:
                with deadline(check.deadline_s):
                    check.run(self)
            except DeadlineExceeded:
                self.record("deadline", [f"MISMATCH {check.name}: its {check.deadline_s:g} s deadline passed after "
                                         f"{len(self.rows) - before} case(s); the rest did not run"], 0.0)
            except Exception as e:  # outside any case: set-up of the check itself
                self.record("setup", [f"MISMATCH {check.name}: raised {type(e).__name__}: {first_line(e)}"], 0.0)
            print(f"[{check.name}] {time.perf_counter() - t0:.1f} s", flush=True)

    def problems(self) -> list[str]:
        return [line for row in self.rows for line in row["problems"]]


def first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def summary_table(stage: Stage, checks: list[Check]) -> list[str]:
    lines = ["| check | cases | ok | mismatches | seconds | deadline s |", "|---|---|---|---|---|---|"]
    for check in checks:
        rows = [r for r in stage.rows if r["check"] == check.name]
        if check.needs_cuda and not stage.cuda:
            lines.append(f"| {check.name} | - | - | - | - | needs CUDA |")
            continue
        bad = sum(len(r["problems"]) for r in rows)
        lines.append(f"| {check.name} | {len(rows)} | {sum(r['ok'] for r in rows)} | {bad} | "
                     f"{sum(r['seconds'] for r in rows):.1f} | {check.deadline_s:.0f} |")
    return lines


def mismatch(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> str | None:
    """None when max |got - want| <= tol * max |want| (compared in float64 on the CPU), else one line
    naming the check, the error and the tolerance."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    if got.shape != want.shape:
        return f"MISMATCH {name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    bad = (~torch.isfinite(got)).sum().item()
    if bad:
        return f"MISMATCH {name}: {bad} non-finite values"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    if err <= tol * scale:
        return None
    return f"MISMATCH {name}: max |got - want| = {err:.3g} is {err / scale if scale else math.inf:.3g} of max |want| = {scale:.3g} (tolerance {tol:g})"


def norm_mismatch(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> str | None:
    """None when ||got - want|| <= tol ||want|| (2-norms over the whole tensor), else one line: an error
    spread over every value counts, a few values off (DSA's top-k flipping on near-ties) barely."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    ratio = ((got - want).norm() / want.norm()).item()
    return None if ratio <= tol else f"MISMATCH {name}: ||got - want|| is {ratio:.3g} of ||want|| (tolerance {tol:g})"


def scalar_mismatch(name: str, got: float, want: float, tol: float) -> str | None:
    """The same test for two numbers: |got - want| <= tol |want|."""
    return mismatch(name, torch.tensor([got]), torch.tensor([want]), tol)


@contextmanager
def counting(module_name: str, attr: str):
    """Wraps module.attr so that calls are counted (yields a one-element list); restores it after."""
    import importlib

    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    count = [0]

    def wrapper(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    setattr(module, attr, wrapper)
    try:
        yield count
    finally:
        setattr(module, attr, original)


def training_model_config(mixer: str, vocab_size: int | None = None, overrides: tuple[str, ...] = ()):
    """The LMConfig stage train builds for `mixer` (model=125m; vocab from the data config unless given),
    with train.py `overrides` on top."""
    from runs.config import compose, lm_config

    cfg = compose(["model=125m", f"mixer={mixer}", *overrides])
    return lm_config(cfg, vocab_size or cfg.data.vocab_size, 0)
