"""A sweep's grid: train.py overrides with `key=a,b,c` axes expanded in the order given (plus the axes an experiment
declares in hydra.sweeper.params), each job named by its swept values, composed and checked as train.py would
before any starts; --match-params sets each job's FFN width so that its parameter count matches the first job's."""
import itertools
import re
import time
from pathlib import Path

from training.jobs import check_job, compose, meta_model

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
    first = [f"{key}={split_values(value)[0]}" for key, _, value in (o.partition("=") for o in overrides)]
    given = {o.partition("=")[0].lstrip("+~") for o in overrides}
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


def plan(overrides: list[str], out: Path, match: str = "none") -> tuple[list[dict], str | None]:
    """The sweep's jobs ({job, name, overrides, run_dir, params, steps, status}), each composed and checked as
    train.py would before any starts (a bad one: ValueError naming it), and the W&B group they share (None where
    logger.group is given). overrides: with the config's axes (with_config_axes)."""
    grid = expand_grid(overrides)
    given_group = any(o.lstrip("+~").startswith("logger.group=") for o in overrides)
    group = None if given_group else f"{compose(grid[0]).get('experiment_name') or 'sweep'}-{time.strftime('%Y%m%d-%H%M%S')}"
    jobs, target = [], None
    for i, job in enumerate(grid):
        if group:
            job = job + [f"++logger.group={group}"]
        cfg = compose(job)
        if match != "none":
            if target is None:
                target = parameter_counts(cfg)[match]
            else:
                job = job + [f"model.intermediate_size={match_intermediate_size(cfg, target, match)}"]
                cfg = compose(job)
        name = f"{i}_{job_name(grid[i], overrides)}"
        try:
            params = check_job(cfg, job).parameter_counts()
        except ValueError as e:
            raise ValueError(f"job {name}: {e}") from None
        jobs.append({"job": i, "name": name, "overrides": job, "run_dir": str(out / name),
                     "params": params, "steps": cfg.trainer.max_steps, "status": "pending"})
    return jobs, group
