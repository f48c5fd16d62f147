"""The one job runner (scripts/sweep.py and every study driver). run_jobs: each job a train.py process under a
launcher (plain python or `accelerate launch`), `parallel` at once on cpu_count / parallel threads each, its console
in <run_dir>.log beside the run dir; a failed job is reported and the others go on; Ctrl-C waits for the running
jobs (they got the SIGINT too and checkpoint) and starts no more. run_pending: each job a python callable in a fresh
process, its result a line of a runs.jsonl log, for the studies that train models train.py cannot
(studies/side_by_side.py)."""
import json
import os
import signal
import subprocess
import sys
import time
from multiprocessing import get_context
from pathlib import Path

from runs.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = ("accelerate", "python")


def launcher_command(launcher: str = "python", accelerate_config: str | None = None,
                     num_processes: int | None = None) -> list[str]:
    if launcher == "python":
        return [sys.executable]
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]  # = `accelerate launch`
    if accelerate_config:
        cmd += ["--config_file", accelerate_config]
    if num_processes:
        cmd += ["--num_processes", str(num_processes)]
    return cmd


def log_path(job: dict) -> Path:
    return Path(job["run_dir"]).parent / f"{job['name']}.log"


def finished(run_dir: Path) -> bool:
    """The run wrote its final export (train.py's last act)."""
    return (Path(run_dir) / "final" / "config.json").exists()


def final_val_loss(run_dir: Path) -> float | None:
    evals = [r["val/loss"] for r in read_metrics(run_dir) if "val/loss" in r]
    return evals[-1] if evals and (Path(run_dir) / "final").exists() else None


def start(cmd: list[str], log, env: dict | None) -> subprocess.Popen:
    """One job's process, its console into the open log file (tests swap in an in-process run here)."""
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)


def run_jobs(jobs: list[dict], launcher: list[str] | None = None, parallel: int = 1,
             status_file: Path | None = None) -> list[dict]:
    """Runs each job ({name, overrides, run_dir}: train.py <overrides> run_dir=<run_dir>) and records in it its
    status (ok, failed, interrupted), seconds, returncode and final val loss, written to status_file after each.
    Re-raises a KeyboardInterrupt once the running jobs have ended."""
    launcher = launcher or [sys.executable]
    env = None
    if parallel > 1:  # each concurrent job gets its share of the cores
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // parallel))}
    pending, running = list(enumerate(jobs, 1)), {}

    def finish(i, j, rc, t0):
        j.update(seconds=round(time.time() - t0, 1), returncode=rc, val_loss=final_val_loss(Path(j["run_dir"])))
        j["status"] = "ok" if rc == 0 else "interrupted" if rc is None else "failed"
        print(f"[{i}/{len(jobs)}] {j['name']}: {j['status']} in {j['seconds']:.0f}s"
              + (f", val loss {j['val_loss']:.4f}" if j["val_loss"] else ""), flush=True)
        if j["status"] != "ok":
            tail = log_path(j).read_text(errors="replace").strip().splitlines()[-3:]
            print("    " + "\n    ".join([*tail, f"(log: {log_path(j)})"]), flush=True)
        if status_file:
            status_file.write_text(json.dumps(jobs, indent=1))

    try:
        while pending or running:
            while pending and len(running) < parallel:
                i, j = pending.pop(0)
                run_dir = Path(j["run_dir"])
                # hydra.run.dir: Hydra's own files (.hydra/, train.log) go into the run dir on rank 0 only.
                cmd = launcher + [str(ROOT / "train.py"), *j["overrides"], f"run_dir={run_dir}",
                                  f"hydra.run.dir=${{rank_zero_dir:{run_dir}}}"]
                with open(log_path(j), "a") as log:
                    running[i] = (j, start(cmd, log, env), time.time())
            for i, (j, proc, t0) in list(running.items()):
                if proc.poll() is not None:
                    del running[i]
                    finish(i, j, proc.returncode, t0)
            time.sleep(0.2)
    except KeyboardInterrupt:
        for i, (j, proc, t0) in running.items():
            proc.wait()
            finish(i, j, None, t0)
        raise
    return jobs


def summary_lines(jobs: list[dict]) -> list[str]:
    """A table of the jobs (status, seconds, final val loss) and the count of those that went well."""
    lines = [f"\n{'job':<32} {'status':<11} {'seconds':>8} {'val loss':>9}"]
    for j in jobs:
        loss = f"{j['val_loss']:.4f}" if j.get("val_loss") else "-"
        lines.append(f"{j['name']:<32} {j['status']:<11} {j.get('seconds', 0):>8.0f} {loss:>9}")
    failed = [j["name"] for j in jobs if j["status"] != "ok"]
    return lines + [f"{len(jobs) - len(failed)}/{len(jobs)} ok" + (f"; not ok: {', '.join(failed)}" if failed else "")]


def run_pending(jobs: list[dict], run, key, log: Path, parallel: int, describe) -> None:
    """run(job) for each job whose key(job) is not in the runs.jsonl `log` yet, `parallel` at once, each in a fresh
    process (maxtasksperchild=1: a job may patch modules for its whole process, as a side-by-side reference blocks
    fla's import; leaving the block, or a kill, terminates the workers), each result appended to the log as it lands
    and printed with describe(result) and its cpu_s."""
    done = {key(r) for r in read_runs(log)}
    todo = [j for j in jobs if key(j) not in done]
    print(f"{len(jobs)} runs, {len(jobs) - len(todo)} already in {log}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"stopped; {log} keeps the finished runs"))
    with get_context("spawn").Pool(parallel, maxtasksperchild=1) as pool:
        for i, r in enumerate(pool.imap_unordered(run, todo), 1):
            with log.open("a") as fh:
                fh.write(json.dumps(r) + "\n")
            print(f"[{i}/{len(todo)}] {describe(r)} ({r['cpu_s']:.0f} CPU s)", flush=True)


def read_runs(log: Path) -> list[dict]:
    """run_pending's results in the runs.jsonl `log` (none when it is not there)."""
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
