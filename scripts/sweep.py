"""Run a grid of train.py jobs one after another (or --jobs at once on CPU), each under `accelerate
launch` (or plain python), continuing past failed jobs, then print a summary.

    python scripts/sweep.py mixer=softmax,mamba2,gdn,derived_gdn,dsa ffn=dense,moe experiment=compare \
        [--accelerate-config configs/accelerate/multi_gpu.yaml] [--launcher python] [--match-params active] \
        [--out multirun/compare] [--jobs 2] [--dry-run]

Arguments are train.py overrides; `key=a,b,c` (commas outside brackets) is a sweep axis, the grid
is their product in the order given (the first job is the reference for --match-params). Each job
runs as its own `accelerate launch train.py <overrides> run_dir=<out>/<i>_<values>`, so a sweep is
never run inside every rank (as `train.py -m` under `accelerate launch` would). Every job gets one
W&B group, `<experiment or sweep>-<date>-<time>` (printed; unless logger.group is given). Output: one run dir
per job, its console log <out>/<i>_<values>.log, and <out>/sweep.json (job, overrides, status,
seconds, final val loss), updated after every job; exit status 1 if any job failed.

An experiment may declare default axes in hydra.sweeper.params (experiment=mqar sweeps trainer.lr):
they are added after the given ones, unless the key is given on the command line (which then wins),
so `train.py -m` and this script sweep the same grid.

--match-params active|total sets model.intermediate_size of every job so that its active (or total)
parameter count is the closest to the first job's (the FFN absorbs the mixers' differences; a MoE's
expert width follows intermediate_size when expert_intermediate_size is null). Counts come from
building each model on the meta device.

--jobs N (plain python only) runs N jobs at once with OMP_NUM_THREADS = cpu_count / N each: on a small
CPU, tiny models train faster per core on one thread, so two jobs at once finish a grid sooner. Their
tokens/s then share the machine: compare throughput only between jobs of one sweep.
"""
import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from training.jobs import check_job, compose, meta_model

ROOT = Path(__file__).resolve().parents[1]

LAUNCHERS = ("accelerate", "python")
MATCH = ("none", "active", "total")


def split_values(value: str) -> list[str]:
    """'a,b,[c,d]' -> ['a', 'b', '[c,d]']: commas at bracket depth 0 separate sweep values."""
    parts, depth, current = [], 0, ""
    for ch in value:
        depth += ch in "[{(" or -(ch in "]})")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return parts + [current]


def expand_grid(overrides: list[str]) -> list[list[str]]:
    """['a=1,2', 'b=x', 'c=3,4'] -> [['a=1','b=x','c=3'], ['a=1','b=x','c=4'], ['a=2', ...], ...]."""
    axes = []
    for arg in overrides:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ValueError(f"override {arg!r} is not key=value")
        axes.append([f"{key}={v}" for v in split_values(value)])
    return [list(job) for job in itertools.product(*axes)]


def job_name(job: list[str], overrides: list[str]) -> str:
    """The swept values joined by '-' (e.g. 'softmax-moe'), filesystem-safe."""
    swept = [arg.partition("=")[2] for arg, given in zip(job, overrides) if len(split_values(given.partition("=")[2])) > 1]
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", "-".join(swept) or "job")


def with_config_axes(overrides: list[str]) -> list[str]:
    """overrides + the axes the composed config (of each axis' first value) declares in
    hydra.sweeper.params whose key is not given."""
    from training.config import resolve_aliases

    first = [f"{key}={split_values(value)[0]}" for key, _, value in (o.partition("=") for o in overrides)]
    given = {o.partition("=")[0].lstrip("+~") for o in resolve_aliases(overrides)}
    params = compose(first, hydra=True).hydra.sweeper.params or {}
    return overrides + [f"{key}={value}" for key, value in params.items() if key not in given]


def parameter_counts(cfg, intermediate_size: int | None = None) -> dict[str, int]:
    """DecoderLM.parameter_counts() of the config (with this FFN width), built on the meta device; the
    vocabulary is the same for every job, so it cancels out in the matching."""
    return meta_model(cfg, intermediate_size).parameter_counts()


def match_intermediate_size(cfg, target: int, which: str, multiple: int = 16) -> int:
    """The multiple of `multiple` whose `which` parameter count is the closest to target (counts are
    linear in intermediate_size up to rounding: solve from two points, then check the neighbours)."""
    lo, hi = 4 * multiple, 64 * multiple
    c_lo, c_hi = parameter_counts(cfg, lo)[which], parameter_counts(cfg, hi)[which]
    guess = lo + (target - c_lo) * (hi - lo) / max(c_hi - c_lo, 1)
    base = max(multiple, round(guess / multiple) * multiple)
    candidates = [max(multiple, base + d * multiple) for d in (-1, 0, 1)]
    return min(candidates, key=lambda i: abs(parameter_counts(cfg, i)[which] - target))


def launcher_command(args) -> list[str]:
    if args.launcher == "python":
        return [sys.executable]
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]  # = `accelerate launch`
    if args.accelerate_config:
        cmd += ["--config_file", args.accelerate_config]
    if args.num_processes:
        cmd += ["--num_processes", str(args.num_processes)]
    return cmd


def final_val_loss(run_dir: Path) -> float | None:
    from training.metrics import read_metrics

    evals = [r["val/loss"] for r in read_metrics(run_dir) if "val/loss" in r]
    return evals[-1] if evals and (run_dir / "final").exists() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="train.py overrides; key=a,b,c sweeps")
    p.add_argument("--launcher", default="accelerate", help=f"one of {', '.join(LAUNCHERS)} (default accelerate)")
    p.add_argument("--accelerate-config", help="accelerate launch --config_file (e.g. configs/accelerate/multi_gpu.yaml)")
    p.add_argument("--num-processes", type=int, help="accelerate launch --num_processes")
    p.add_argument("--match-params", default="none", help=f"one of {', '.join(MATCH)}: match model.intermediate_size to the first job")
    p.add_argument("--out", help="sweep folder (default multirun/<date>/<time>_sweep)")
    p.add_argument("--jobs", type=int, default=1,
                   help="jobs run at once (launcher python only), each on cpu_count/jobs threads; default 1")
    p.add_argument("--dry-run", action="store_true", help="print the jobs and their parameter counts, run nothing")
    args = p.parse_intermixed_args(argv)  # overrides may come after the options
    if args.launcher not in LAUNCHERS:
        sys.exit(f"error: unknown --launcher {args.launcher!r}; valid: {', '.join(LAUNCHERS)}")
    if args.match_params not in MATCH:
        sys.exit(f"error: unknown --match-params {args.match_params!r}; valid: {', '.join(MATCH)}")
    if args.jobs < 1 or (args.jobs > 1 and args.launcher != "python"):
        sys.exit(f"error: --jobs {args.jobs}; valid: 1, or more with --launcher python (accelerate jobs already use every device)")
    if args.match_params != "none" and any(o.startswith("model.intermediate_size=") for o in args.overrides):
        sys.exit("error: --match-params sets model.intermediate_size; do not override it too")
    from training.config import check_group_overrides

    check_group_overrides(args.overrides)
    try:
        overrides = with_config_axes(args.overrides)
        grid = expand_grid(overrides)
    except ValueError as e:
        sys.exit(f"error: {e}")
    out = Path(args.out or ROOT / "multirun" / time.strftime("%Y-%m-%d") / f"{time.strftime('%H-%M-%S')}_sweep").resolve()

    # One W&B group for the whole sweep (unless given): its jobs are one comparison.
    given_group = any(o.lstrip("+~").startswith("logger.group=") for o in overrides)
    group = None if given_group else f"{compose(grid[0]).get('experiment_name') or 'sweep'}-{time.strftime('%Y%m%d-%H%M%S')}"
    jobs, target = [], None
    for i, job in enumerate(grid):
        if group:
            job = job + [f"++logger.group={group}"]
        cfg = compose(job)
        if args.match_params != "none":
            if target is None:
                target = parameter_counts(cfg)[args.match_params]
            else:
                job = job + [f"model.intermediate_size={match_intermediate_size(cfg, target, args.match_params)}"]
                cfg = compose(job)
        name = f"{i}_{job_name(grid[i], overrides)}"
        try:  # every job checked as train.py would, before any starts
            params = check_job(cfg, job).parameter_counts()
        except ValueError as e:
            sys.exit(f"error: job {name}: {e}")
        jobs.append({"job": i, "name": name, "overrides": job, "run_dir": str(out / name),
                     "params": params, "steps": cfg.trainer.max_steps, "status": "pending"})
    launcher = launcher_command(args)
    shown = "python" if args.launcher == "python" else " ".join(["accelerate launch", *launcher[3:]])
    print(f"sweep of {len(jobs)} job(s) -> {out}\nlauncher: {shown} train.py ..."
          + (f"\nW&B group (with logger=wandb): {group}" if group else ""))
    for j in jobs:
        print(f"  {j['name']}: {' '.join(j['overrides'])} | {j['params']['total'] / 1e6:.3f}M params "
              f"({j['params']['active'] / 1e6:.3f}M active) | {j['steps']} steps")
    if args.dry_run:
        return 0

    out.mkdir(parents=True, exist_ok=True)
    env = None
    if args.jobs > 1:  # each concurrent job gets its share of the cores
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.jobs))}
    pending, running = list(jobs), {}

    def finish(j, rc, t0):
        j.update(seconds=round(time.time() - t0, 1), returncode=rc, val_loss=final_val_loss(Path(j["run_dir"])))
        j["status"] = "ok" if rc == 0 else "interrupted" if rc is None else "failed"
        print(f"[{j['job'] + 1}/{len(jobs)}] {j['name']}: {j['status']} in {j['seconds']:.0f}s"
              + (f", val loss {j['val_loss']:.4f}" if j["val_loss"] else ""), flush=True)
        if j["status"] != "ok":
            tail = (out / f"{j['name']}.log").read_text(errors="replace").strip().splitlines()[-3:]
            print("    " + "\n    ".join(tail))
        (out / "sweep.json").write_text(json.dumps(jobs, indent=1))

    try:
        while pending or running:
            while pending and len(running) < args.jobs:
                j = pending.pop(0)
                run_dir = Path(j["run_dir"])
                # hydra.run.dir: Hydra's own files (.hydra/, train.log) go into the run dir on rank 0 only.
                cmd = launcher + [str(ROOT / "train.py"), *j["overrides"], f"run_dir={run_dir}",
                                  f"hydra.run.dir=${{rank_zero_dir:{run_dir}}}"]
                with open(out / f"{j['name']}.log", "w") as log:
                    running[j["job"]] = (j, subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env),
                                         time.time())
            for key, (j, proc, t0) in list(running.items()):
                if proc.poll() is not None:
                    del running[key]
                    finish(j, proc.returncode, t0)
            time.sleep(0.2)
    except KeyboardInterrupt:  # the jobs got the SIGINT too (they checkpoint); wait for them, start no more
        for j, proc, t0 in running.values():
            proc.wait()
            finish(j, None, t0)

    print(f"\n{'job':<32} {'status':<11} {'seconds':>8} {'val loss':>9}")
    for j in jobs:
        loss = f"{j['val_loss']:.4f}" if j.get("val_loss") else "-"
        print(f"{j['name']:<32} {j['status']:<11} {j.get('seconds', 0):>8.0f} {loss:>9}")
    failed = [j["name"] for j in jobs if j["status"] != "ok"]
    print(f"{len(jobs) - len(failed)}/{len(jobs)} ok" + (f"; not ok: {', '.join(failed)}" if failed else "")
          + f"\ncompare: python scripts/compare.py {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
