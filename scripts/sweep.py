"""Run a grid of train.py jobs one after another (or --jobs at once on CPU), each under `accelerate
launch` (or plain python), continuing past failed jobs, then print a summary (docs/comparing.md, The sweep).

    python scripts/sweep.py mixer=softmax,mamba2,gdn,derived_gdn,dsa ffn=dense,moe experiment=compare \
        [--accelerate-config configs/accelerate/multi_gpu.yaml] [--launcher python] [--match-params active] \
        [--out multirun/compare] [--jobs 2] [--dry-run]

Arguments are train.py overrides; `key=a,b,c` (commas outside brackets) is a sweep axis, the grid
is their product in the order given (the first job is the reference for --match-params), plus the axes the
experiment declares in hydra.sweeper.params unless given. Each job runs as its own `accelerate launch train.py
<overrides> run_dir=<out>/<i>_<values>`; every job gets one W&B group (printed; unless logger.group is given).
Output: one run dir per job, its console log <out>/<i>_<values>.log, and <out>/sweep.json (job, overrides,
status, seconds, final val loss), updated after every job; exit status 1 if any job failed. Before any job starts,
each is composed and checked as train.py would (--match-params: with its FFN width set so that its parameter count
matches the first job's).
"""
import argparse
import sys
import time
from pathlib import Path

from analysis.runner import LAUNCHERS, ROOT, launcher_command, run_jobs, summary_lines
from runs.config import check_group_overrides, compose, meta_model
from runs.sweep import sweep_jobs
from training.jobs import check_job
from common.validation import error_message

MATCH = ("none", "active", "total")


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


def plan(overrides: list[str], out: Path, match: str = "none") -> tuple[list[dict], str | None]:
    """The sweep's jobs ({job, name, overrides, run_dir, params, steps, status}) of the command line's overrides (with
    the config's axes: runs/sweep.py sweep_jobs), each composed and checked as train.py would before any starts (a bad
    one: ValueError naming it), and the W&B group they share (None where logger.group is given)."""
    named = sweep_jobs(overrides)
    given_group = any(o.lstrip("+~").startswith("logger.group=") for o in overrides)
    group = None if given_group else f"{compose(named[0][1]).get('experiment_name') or 'sweep'}-{time.strftime('%Y%m%d-%H%M%S')}"
    jobs, target = [], None
    for i, (name, job) in enumerate(named):
        if group:
            job = job + [f"++logger.group={group}"]
        cfg = compose(job)
        if match != "none":
            if target is None:
                target = parameter_counts(cfg)[match]
            else:
                job = job + [f"model.intermediate_size={match_intermediate_size(cfg, target, match)}"]
                cfg = compose(job)
        try:
            params = check_job(cfg, job).parameter_counts()
        except ValueError as e:
            raise ValueError(f"job {name}: {e}") from None
        jobs.append({"job": i, "name": name, "overrides": job, "run_dir": str(out / name),
                     "params": params, "steps": cfg.trainer.max_steps, "status": "pending"})
    return jobs, group



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
    check_group_overrides(args.overrides)
    out = Path(args.out or ROOT / "multirun" / time.strftime("%Y-%m-%d") / f"{time.strftime('%H-%M-%S')}_sweep").resolve()
    try:
        jobs, group = plan(args.overrides, out, args.match_params)
    except ValueError as e:
        sys.exit(error_message(e))
    launcher = launcher_command(args.launcher, args.accelerate_config, args.num_processes)
    shown = "python" if args.launcher == "python" else " ".join(["accelerate launch", *launcher[3:]])
    print(f"sweep of {len(jobs)} job(s) -> {out}\nlauncher: {shown} train.py ..."
          + (f"\nW&B group (with logger=wandb): {group}" if group else ""))
    for j in jobs:
        print(f"  {j['name']}: {' '.join(j['overrides'])} | {j['params']['total'] / 1e6:.3f}M params "
              f"({j['params']['active'] / 1e6:.3f}M active) | {j['steps']} steps")
    if args.dry_run:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    try:
        run_jobs(jobs, launcher, args.jobs, out / "sweep.json")
    except KeyboardInterrupt:  # the running jobs have ended; the rest stay pending
        pass
    print("\n".join(summary_lines(jobs)) + f"\ncompare: python scripts/compare.py {out}")
    return 1 if any(j["status"] != "ok" for j in jobs) else 0


if __name__ == "__main__":
    sys.exit(main())
