"""A sweep's jobs, expanded one way for scripts/sweep.py and `train.py -m`'s checks: train.py overrides
with `key=a,b,c` axes (commas outside brackets; Hydra's range() and choice() too), the grid their product in the order given, plus the axes the
composed config declares in hydra.sweeper.params (an experiment's defaults) unless their key is given; each job
named by its swept values."""
import itertools
import re

from runs.config import compose, override_key


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


def axis(arg: str) -> list[str]:
    """An override as the jobs' overrides of its axis, as Hydra's basic sweeper reads it: 'a=1,2' -> ['a=1', 'a=2']
    (the values as typed), 'a=range(1,3)' or 'a=choice(x,y)' -> Hydra's values; a deletion '~a' is itself."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    key, sep, value = arg.partition("=")
    if not sep:
        if arg.startswith("~"):
            return [arg]
        raise ValueError(f"override {arg!r} is not key=value")
    override = OverridesParser.create().parse_overrides([arg])[0]
    if not override.is_sweep_override():
        return [arg]
    if isinstance(override.value(), ChoiceSweep) and override.value().simple_form:
        return [f"{key}={v}" for v in split_values(value)]
    return [f"{key}={v}" for v in override.sweep_string_iterator()]


def expand_grid(overrides: list[str]) -> list[list[str]]:
    """['a=1,2', 'b=x', 'c=3,4'] -> [['a=1','b=x','c=3'], ['a=1','b=x','c=4'], ['a=2', ...], ...]."""
    return [list(job) for job in itertools.product(*map(axis, overrides))]


def with_config_axes(overrides: list[str]) -> list[str]:
    """overrides + the axes the composed config (of each axis' first value) declares in
    hydra.sweeper.params whose key is not given."""
    given = {override_key(o) for o in overrides}
    params = compose([axis(o)[0] for o in overrides], hydra=True).hydra.sweeper.params or {}
    return overrides + [f"{key}={value}" for key, value in params.items() if key not in given]


def job_name(job: list[str], overrides: list[str]) -> str:
    """The swept values joined by '-' (e.g. 'softmax-moe'), filesystem-safe."""
    swept = [arg.partition("=")[2] for arg, given in zip(job, overrides) if len(axis(given)) > 1]
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", "-".join(swept) or "job")


def sweep_jobs(overrides: list[str]) -> list[tuple[str, list[str]]]:
    """(name, overrides) of each job of a sweep's command line: its grid with the config's own axes, each named
    '<i>_<swept values>'."""
    overrides = with_config_axes(overrides)
    return [(f"{i}_{job_name(job, overrides)}", job) for i, job in enumerate(expand_grid(overrides))]
