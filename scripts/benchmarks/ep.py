"""Expert parallelism on CPU: 2 processes (gloo) with the experts split over them (trainer.expert_parallel=2)
against 2 processes of plain DDP (every expert on both), at the default recipe's MoE shape (model=tiny
with ffn=moe: d 256, E 8, k 2; 8 x 256 tokens a step), through train.py under `accelerate launch`.
Per run: the median step time over the logs after the first, the main process's peak memory (resident
set on CPU), and for EP the all-to-all seconds and bytes per step (training/parallel.py). The two runs
go one after the other in the same bench run; read the ratios. On 2 CPU cores the all-to-all is a
memory copy between processes, so this measures the overhead of dispatch, not what EP buys on a
cluster (parameter and optimizer memory per device: docs/distributed.md works out the all-to-all
volume per token for larger configs).
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.benchmarks.common import ROOT, markdown_table
from runs.metrics import median_after_first

LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml")]


def train(run_dir: Path, steps: int, *overrides: str) -> list[dict]:
    cmd = [*LAUNCH, str(ROOT / "train.py"), "ffn=moe", "logger=none", f"trainer.max_steps={steps}", "trainer.warmup_steps=0",
           "trainer.log_every=2", f"trainer.eval_every={steps}", "trainer.eval_batches=1", "trainer.sample_tokens=0",
           f"trainer.ckpt_every={10 * steps}", f"run_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(quick: bool) -> str:
    steps = 6 if quick else 30
    with tempfile.TemporaryDirectory() as tmp:
        ddp = train(Path(tmp) / "ddp", steps)
        ep = train(Path(tmp) / "ep", steps, "trainer.expert_parallel=2")
    t_ddp, t_ep = median_after_first(ddp, "perf/step_time"), median_after_first(ep, "perf/step_time")
    m_ddp, m_ep = max(r["perf/peak_mem_gb"] for r in ddp if "perf/peak_mem_gb" in r), \
        max(r["perf/peak_mem_gb"] for r in ep if "perf/peak_mem_gb" in r)
    a2a_s, a2a_b = median_after_first(ep, "ep/a2a_seconds"), median_after_first(ep, "ep/a2a_bytes")
    rows = [["DDP, every expert on both", f"{t_ddp:.3f}", "1.00", f"{m_ddp:.3f}", "1.00", "-", "-"],
            ["EP 2 (4 experts each)", f"{t_ep:.3f}", f"{t_ep / t_ddp:.2f}", f"{m_ep:.3f}", f"{m_ep / m_ddp:.2f}",
             f"{a2a_s:.3f}", f"{a2a_b / 1e6:.2f}"]]
    return (f"2 gloo processes, 1 thread each, {steps} steps (median step after the first log window)\n\n"
            + markdown_table(["run", "step s", "step / DDP", "peak RSS GB (rank 0)", "memory / DDP",
                              "all-to-all s per step", "all-to-all MB sent per step (rank)"], rows))
