"""Stage train: each mixer's train.py config planned and validated on the CPU, the token cache built once, then
train.py model=125m at T=2048 per mixer for an equal share of the time left (stopped by SIGTERM), read back from
its metrics.jsonl."""
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from checks.stage import Check, Stage
from runs.metrics import median_after_first

ROOT = Path(__file__).resolve().parents[1]

TRAIN_T, TRAIN_BATCH, LOG_EVERY = 2048, 8, 5
STOP_GRACE_S = 8  # after SIGTERM, for train.py to finish its step and save before it is killed


def train_overrides(mixer: str, run_dir: Path | str) -> list[str]:
    """train.py's overrides for one run: model=125m at T=2048, more steps than fit (the run is stopped)."""
    return ["model=125m", f"mixer={mixer}", "logger=none", f"trainer.seq_len={TRAIN_T}",
            f"trainer.batch_size={TRAIN_BATCH}", "trainer.max_steps=100000", "trainer.warmup_steps=10",
            f"trainer.log_every={LOG_EVERY}", "trainer.eval_every=100000", "trainer.eval_batches=1",
            "trainer.ckpt_every=100000", "trainer.sample_tokens=0", f"run_dir={run_dir}"]


def check_plan(stage: Stage) -> None:
    """Each mixer's train.py config composes and passes train.py's validation; its model's size and FLOPs."""
    from model import DecoderLM
    from runs.config import compose, lm_config
    from training.validation import check_train_config

    for mixer in stage.mixers:
        def case(mixer=mixer):
            cfg = compose(train_overrides(mixer, "unused"))
            check_train_config(cfg)
            with torch.device("meta"):
                model = DecoderLM(lm_config(cfg, cfg.data.vocab_size, 0))
            params = model.parameter_counts()["total"]
            flops = model.flops_per_token(TRAIN_T, "cuda")
            print(f"    {mixer}: {params / 1e6:.1f}M parameters, {flops / 1e9:.2f} GFLOP/token forward at T={TRAIN_T}")
            stage.plan[mixer] = {"parameters": params, "forward_flops_per_token": flops}
        stage.case(mixer, case)


def check_data(stage: Stage) -> None:
    """The token cache every run reads (data's default config), built here once rather than in the first run."""
    from data import build_data
    from runs.config import compose

    def build():
        cfg = compose(train_overrides(stage.mixers[0], "unused"))
        data = build_data(cfg.data, TRAIN_T, cfg.seed)
        print(f"    {len(data.train)} train sequences of {TRAIN_T} tokens")
    stage.case("token cache", build)


def summarize_run(rows: list[dict]) -> tuple[dict, list[str]]:
    """A run's measurements from its metrics.jsonl rows: tokens/s and MFU (medians over the log windows
    after the first, which holds compilation and autotuning), peak memory, first and last window's train
    loss; and its problems (fewer than two windows, a loss that did not fall, an MFU above 1)."""
    logged = [r for r in rows if "perf/tokens_per_sec" in r]
    if len(logged) < 2:
        return {"windows": len(logged)}, [f"only {len(logged)} log window(s) of {LOG_EVERY} steps in the time given"]
    result = {"windows": len(logged), "steps": logged[-1].get("step"),
              "tokens_per_sec": median_after_first(logged, "perf/tokens_per_sec"),
              "mfu": median_after_first(logged, "perf/mfu"), "peak_mem_gb": max(r["perf/peak_mem_gb"] for r in logged),
              "loss_first": logged[0]["train/loss"], "loss_last": logged[-1]["train/loss"]}
    problems = []
    if not result["loss_last"] < result["loss_first"]:
        problems.append(f"train loss did not fall ({result['loss_first']:.3f} -> {result['loss_last']:.3f})")
    if result["mfu"] is not None and result["mfu"] > 1:
        problems.append(f"MFU {result['mfu']:.2f} > 1 (the FLOP count or the peak table is wrong)")
    return result, problems


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (train.py saves and exits after its step), then SIGKILL after STOP_GRACE_S."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def check_train(stage: Stage) -> None:
    """train.py model=125m per mixer, each for an equal share of the stage's time left."""
    from runs.metrics import read_metrics

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for i, mixer in enumerate(stage.mixers):
            slot = (stage.time_left() - 5) / (len(stage.mixers) - i)  # 5 s for the summary
            t0 = time.perf_counter()
            run_dir = Path(tmp) / mixer
            log = Path(tmp) / f"{mixer}.log"  # a file, not a pipe: nothing reads it while train.py runs
            with log.open("w") as out:
                proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *train_overrides(mixer, run_dir)],
                                        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=out, stderr=out)
            try:
                proc.wait(max(slot - STOP_GRACE_S, 1))
                ended = "exited by itself"
            except subprocess.TimeoutExpired:
                ended = "stopped"
            finally:
                stop(proc)
            seconds = time.perf_counter() - t0
            rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
            result, problems = summarize_run(rows)
            if ended == "exited by itself" and proc.returncode:
                problems.insert(0, f"train.py exited {proc.returncode}: {(log.read_text().strip().splitlines() or ['no output'])[-1]}")
            stage.record(mixer, [f"MISMATCH train {mixer}: {p}" for p in problems], seconds, slot_s=round(slot, 1), **result)


def train_table(stage: Stage) -> list[str]:
    lines = ["| mixer | tokens/s | MFU | peak mem GB | train loss (first -> last window) | steps | s |",
             "|---|---|---|---|---|---|---|"]
    for r in (r for r in stage.rows if r["check"] == "train" and "tokens_per_sec" in r):
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(f"| {r['case']} | {r['tokens_per_sec']:,.0f} | {mfu} | {r['peak_mem_gb']:.1f} | "
                     f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} | {r['steps']} | {r['seconds']:.0f} |")
    return lines


TRAIN_CHECKS = [Check("plan", check_plan, 30, needs_cuda=False), Check("data", check_data, 60),
                Check("train", check_train, 185)]
