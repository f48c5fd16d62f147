"""eval.py's suites, one file each, registered by name: `python eval.py checkpoint=... 'suite=[length,recall]'`.

A suite is a class in its own file here, decorated `@SUITES.register("<name>")`, with:

    Options                              a dataclass of its options (model/options.py `option`): eval.py's
                                         <name>.* keys (`length.factors=[1,2,4]`), checked once
    quick_options                        {option: value} small enough for a run in seconds on a tiny model
                                         (the contract tests run every suite so: tests/test_contract_suites.py)
    run(ctx: EvalContext, opts) -> dict  its block of eval.json
    scores(block) -> {key: float}        its flat scores, named <name>/...: eval.json's scores, W&B, compare.py
    plot(block, title, folder) -> [Path] its PNGs of one model, written into folder
    compare(points, out, style)          its tables and figures across runs in compare.py's report, over
                                         EvalPoints (each an architecture at its best value or a run, with the
                                         eval.json of each run it stands for), drawn in the report's style
                                         (common/plots.py SeriesStyle): -> (PNG paths, markdown lines, notes)

eval.py, its config check and compare.py read this registry: a new suite is one file and nothing else. Every module
here is imported as a suite; what a suite uses but is not one lives outside (evaluation/recall_probes.py)."""
import importlib
import pkgutil
import statistics
from dataclasses import dataclass

from common.registry import Registry

SUITES = Registry("suite")


class Suite:
    Options: type
    quick_options: dict = {}

    def run(self, ctx, opts) -> dict:
        raise NotImplementedError

    def scores(self, block: dict) -> dict[str, float]:
        return {}

    def plot(self, block: dict, title: str, folder) -> list:
        return []

    def compare(self, points: list["EvalPoint"], out, style) -> tuple[list, list[str], list[str]]:
        return [], [], []


@dataclass
class EvalPoint:
    label: str
    mixer: str
    reports: list[dict]  # eval.json of each run it stands for (each seed of an architecture at its best value)
    over: str | None = None  # the key whose best value it stands at (None: a run)

    def blocks(self, suite: str) -> list[dict]:
        return [r[suite] for r in self.reports if isinstance(r.get(suite), dict)]


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def points_table(points: list[EvalPoint], columns: list[str], value) -> str | None:
    """compare.md's table of one row per point with any value: value(report, column) (None where it has none)
    averaged over the point's reports, "-" where none has it; None when no point has any."""
    rows = [(p.label, [mean(value(r, c) for r in p.reports) for c in columns]) for p in points]
    rows = [(label, cells) for label, cells in rows if any(c is not None for c in cells)]
    if not rows:
        return None
    lines = [f"| {'architecture' if points[0].over else 'run'} | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join("-" if c is None else f"{c:.4g}" for c in cells) + " |" for label, cells in rows]
    return "\n".join(lines)


def suite_options_node() -> dict:
    """{suite name: its Options dataclass}: the schema of eval.py's per-suite option nodes."""
    return {name: SUITES.get(name).Options for name in SUITES.names()}


for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
