"""The best value of a swept key: runs grouped into architectures (configs that differ only in the key, the seed
and the run's own keys), the one best-over-grid picker (on the seeds that ran at every value), its edge flag and
the command that extends the grid; the report's best-value tables and best_over.json."""
import json
import shlex
import statistics
from dataclasses import dataclass, field
from functools import cached_property

from analysis.runs import Run, cfg_get
from analysis.summary import budget, budget_line, fmt
from common.validation import leaves
from runs.config import override_key

RUN_ONLY = ("seed", "run_dir", "resume", "init_from", "name")  # a run's own keys: not in the command that extends a grid
RUN_KEYS = (*RUN_ONLY, "logger")  # differ between runs of one architecture
BUDGET_KEYS = ("trainer.flops_budget", "trainer.tokens_budget", "trainer.max_steps")
ACCURACIES = ("mqar_acc", "state_acc")  # the scores where higher is better (val_loss: lower)
EDGE_TAG = "best-on-grid-edge"  # the W&B tag of the runs at a flagged architecture's best value


@dataclass
class Best:
    value: object  # the best value
    means: dict  # value -> mean score over the seeds compared, in value order
    seeds: set  # the seeds that ran at every value (empty: none did, every seed is compared)
    edge: str | None  # grid_edge's flag
    beyond: list  # grid_edge's values beyond the best


def best_value(scores: dict, higher_is_better: bool) -> Best | None:
    """The one best-over-grid picker. scores: {value: [(seed, score) of each run]}. Each value's mean over the seeds
    that ran at every value (over every seed where none did: two seeds at one lr against one at another would pit a
    seed's luck against the lr); the best value on these means; where it lies in the grid (grid_edge)."""
    if not scores:
        return None
    seeds = set.intersection(*({seed for seed, _ in runs} for runs in scores.values()))
    means = {v: statistics.mean(x for seed, x in scores[v] if not seeds or seed in seeds) for v in sorted(scores)}
    best = (max if higher_is_better else min)(means, key=means.get)
    return Best(best, means, seeds, *grid_edge(list(means), best))


def grid_edge(values: list, best) -> tuple[str | None, list]:
    """Where the best of the swept values lies: (None, []) strictly inside the grid; ("low edge" or "high edge",
    [the value one step beyond it]), the step continuing the grid's ratio at that end (its difference where a value
    there is <= 0); ("single value", [best / 2, best * 2]). Names (non-numeric values) are flagged only as a
    single value, with nothing beyond."""
    values = sorted(set(values))
    if len(values) == 1:
        flag, beyond = "single value", [best / 2, best * 2] if numeric(values) else []
    elif not numeric(values) or values[0] < best < values[-1]:
        return None, []
    else:
        end, inner = (values[0], values[1]) if best == values[0] else (values[-1], values[-2])
        flag, beyond = ("low edge" if best == values[0] else "high edge"), [end * end / inner if end > 0 and inner > 0
                                                                            else 2 * end - inner]
    return flag, [round(v) for v in beyond] if all(isinstance(v, int) for v in values) else beyond


def numeric(values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def edge_text(key: str, best, values: list, flag: str) -> str:
    """'best trainer.lr 0.02 is at the high edge of the grid (0.005, 0.01, 0.02)' (flag from grid_edge)."""
    where = "the only value swept" if flag == "single value" else f"at the {flag} of the grid"
    return f"best {key} {value_text(best)} is {where} ({', '.join(value_text(v) for v in sorted(values))})"


def value_text(v) -> str:
    """A KEY value as the tables print it: numbers in %g (an lr 0.003), anything else as is (a name)."""
    return f"{v:g}" if numeric([v]) else str(v)


@dataclass
class Architecture:
    label: str
    score: str  # one of ACCURACIES (higher is better) or "val_loss" (lower is better)
    runs: dict = field(default_factory=dict)  # KEY value -> [summary of each seed's run]
    summary: dict = field(default_factory=dict)  # the first run's summary (mixer, d_model, state_size, ...)
    members: dict = field(default_factory=dict)  # KEY value -> [Run of each seed]
    config: dict = field(default_factory=dict)  # the flat config its runs share (without KEY and RUN_KEYS)

    @property
    def points(self) -> dict:
        """KEY value -> [score of each seed]."""
        return {v: [s[self.score] for s in summaries] for v, summaries in self.runs.items()}

    def means(self) -> dict:
        """KEY value -> mean score over every seed, in value order."""
        return {v: statistics.mean(scores) for v, scores in sorted(self.points.items())}

    @cached_property
    def pick(self) -> Best:
        return best_value({v: [(cfg_get(r.config, "seed"), s[self.score]) for r, s in zip(self.members[v], self.runs[v])]
                           for v in self.runs}, self.score in ACCURACIES)

    def budget(self) -> str:
        return budget_line([r.config for members in self.members.values() for r in members])


def grouped(items: list[tuple[Run, dict]], dropped) -> list[tuple[dict, list[tuple[Run, dict]]]]:
    """(run, summary) pairs grouped by their config without the dotted keys dropped(run) names, in first-seen order:
    [(the flat config they share, their pairs)]."""
    groups: dict[str, list] = {}
    for run, s in items:
        config = json.loads(json.dumps(run.config, default=str))
        for dotted in dropped(run):
            parent, _, leaf = dotted.rpartition(".")
            (cfg_get(config, parent, {}) if parent else config).pop(leaf, None)
        groups.setdefault(json.dumps(config, sort_keys=True), []).append((run, s))
    return [(leaves(json.loads(c), lists=False), members) for c, members in groups.items()]


def labels(groups: list[tuple[dict, list]]) -> list[str]:
    """'<mixer>-<ffn>-d<width>' of each group's first run; where several groups share it, each is named by the
    options in which those groups differ (all of them, the first included: 'gdn-dense-d64 allow_neg_eigval=False')."""
    bases = ["-".join(str(members[0][1][c]) for c in ("mixer", "ffn") if members[0][1][c]) + f"-d{members[0][1]['d_model']}"
             for _, members in groups]
    sharing: dict[str, list[dict]] = {}  # base -> the flat configs of the groups named by it
    for base, (config, _) in zip(bases, groups):
        sharing.setdefault(base, []).append(config)
    differing = {base: sorted(k for k in set().union(*configs) if len({value_text(c.get(k)) for c in configs}) > 1)
                 for base, configs in sharing.items()}
    return [f"{base} " + ",".join(f"{k.rpartition('.')[2]}={value_text(config.get(k))}" for k in differing[base])
            if differing[base] else base for base, (config, _) in zip(bases, groups)]


def group_architectures(runs: list[Run], summaries: list[dict], key: str) -> list[Architecture]:
    """Runs grouped by their config without `key` and the per-run keys (RUN_KEYS), in first-seen order; runs at
    different budgets are different architectures (trainer.max_steps is left out where a budget set it)."""
    groups = grouped(list(zip(runs, summaries)), lambda run: [key, *RUN_KEYS] + (
        ["trainer.max_steps"] if budget(run.config)[0] != "steps" else []))
    archs = []
    for label, (config, members) in zip(labels(groups), groups):
        score = next((a for a in ACCURACIES if all(s[a] is not None for _, s in members)), "val_loss")
        arch = Architecture(label, score, summary=members[0][1], config=config)
        for run, s in members:
            arch.runs.setdefault(cfg_get(run.config, key), []).append(s)
            arch.members.setdefault(cfg_get(run.config, key), []).append(run)
        archs.append(arch)
    return archs


def hydra_value(v) -> str:
    if isinstance(v, list):
        return "[" + ",".join(map(hydra_value, v)) + "]"
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def distinguishing_overrides(arch: Architecture, archs: list[Architecture]) -> list[str]:
    """The config entries in which this architecture differs from the others, as train.py overrides: a group's
    choice (mixer=gdn) for its name, the group's options only where they differ among architectures of that choice."""
    def differ(k, among):
        return len({json.dumps(a.config.get(k)) for a in among}) > 1

    out = []
    for k, v in arch.config.items():
        group = k.partition(".")[0]
        choice = arch.config.get(f"{group}.name")
        if not differ(k, archs):
            continue
        if k == f"{group}.name":
            out.append(f"{group}={v}")
        elif choice is None or differ(k, [a for a in archs if a.config.get(f"{group}.name") == choice]):
            out.append(f"{k}={hydra_value(v)}")
    return out


def extension_command(arch: Architecture, archs: list[Architecture], key: str, beyond: list) -> str:
    """scripts/sweep.py with the architecture's overrides (its best run's own command line, else the config entries
    that tell it from the others), KEY at the values beyond the grid, and the same seeds."""
    best = arch.members[arch.pick.value]
    given = best[0].overrides
    if given is None:
        overrides = distinguishing_overrides(arch, archs)
    else:
        names = [override_key(o) for o in given]
        overrides = [o for o, k in zip(given, names) if k != key and k.split(".")[0] not in RUN_ONLY]
    seeds = sorted({r.config["seed"] for r in best if r.config.get("seed") is not None})
    args = [*overrides, f"{key}={','.join(value_text(v) for v in beyond)}"]
    args += [f"seed={','.join(map(str, seeds))}"] if seeds else []
    return "python scripts/sweep.py " + " ".join(map(shlex.quote, args))


def edge_warning(arch: Architecture, archs: list[Architecture], key: str) -> str | None:
    """One line for an architecture whose best KEY is at the edge of its grid (or the only value swept), with the
    command that extends the grid; None when the best is strictly inside."""
    pick = arch.pick
    if pick.edge is None:
        return None
    line = f"{arch.label}: {edge_text(key, pick.value, list(pick.means), pick.edge)}"
    return line + (f"; extend it: {extension_command(arch, archs, key, pick.beyond)}" if pick.beyond else "")


def best_over_table(archs: list[Architecture], key: str) -> str:
    lines = [f"| architecture | score | best {key} | edge | mean | min-max | seeds | mean at every {key} (seeds compared) |",
             "|---|---|---|---|---|---|---|---|"]
    for a in archs:
        pick = a.pick
        scores = a.points[pick.value]
        every = ", ".join(f"{value_text(v)}: {m:.4g}" for v, m in pick.means.items())
        compared = ", ".join(value_text(s) for s in sorted(pick.seeds, key=str)) or "all"
        lines.append(f"| {a.label} | {a.score} | {value_text(pick.value)} | {pick.edge or '-'} | {statistics.mean(scores):.4g} | "
                     f"{min(scores):.4g}-{max(scores):.4g} | {len(scores)} | {every} ({compared}) |")
    return "\n".join(lines)


def best_over_sections(archs: list[Architecture], key: str) -> tuple[list[str], list[str]]:
    """compare.md's best-KEY tables, one pair per budget (one in all when KEY is a budget), each flagged
    architecture's warning in bold under its table; and the warnings."""
    by_budget: dict[str, list[Architecture]] = {}
    for a in archs:
        by_budget.setdefault("" if key in BUDGET_KEYS else a.budget(), []).append(a)
    md, warnings = [], []
    for budget_text, group in by_budget.items():
        lines = [w for a in group if (w := edge_warning(a, archs, key))]
        warnings += lines
        md += [f"## Best {key} per architecture" + (f", {budget_text}" if budget_text else ""), "",
               best_over_table(group, key), "", *[f"**Warning: {w}**\n" for w in lines],
               f"score: MQAR or state-tracking accuracy (higher is better) or val loss (lower is better) at the last evaluation, "
               f"mean and min-max over seeds at the best {key}, which is picked on the seeds that ran at every {key} "
               f"(the means at every {key}); edge: the best is the lowest or highest {key} swept "
               f"(or the only one): the optimum may lie beyond. Every point is in best_{key.replace('.', '_')}/"
               f"<architecture>.png and in the table of every run.", "", f"At the best {key}, means over seeds:", "",
               at_best_table(group, key), ""]
    return md, warnings


def edge_report(archs: list[Architecture], key: str) -> list[dict]:
    """best_over.json: per architecture its budget, score, best value, mean at every value, edge flag, the values
    beyond the edge and the command that sweeps them, and the runs at its best value."""
    return [{"architecture": a.label, "key": key, "budget": a.budget(), "score": a.score, "best": a.pick.value,
             "means": [[v, m] for v, m in a.pick.means.items()], "seeds_compared": sorted(a.pick.seeds, key=str),
             "edge": a.pick.edge, "beyond": a.pick.beyond,
             "command": extension_command(a, archs, key, a.pick.beyond) if a.pick.beyond else None,
             "best_runs": [r.name for r in a.members[a.pick.value]]} for a in archs]


AT_BEST = ("val_bpb", "val_bpb_batch_routing", "moe_imbalance", "moe_dead_experts", "moe_unrouted_frac",
           "moe_token_choice_overlap", "tokens_per_sec", "train_flops")


def slice_columns(summaries: list[dict]) -> list[str]:
    """The slices of the accuracies the summaries have (mqar_acc/<len>x<pairs>, state_acc/<len>), in number order."""
    return sorted({k for s in summaries for k in s if "/" in k and k.partition("/")[0] in ACCURACIES},
                  key=lambda k: (k.partition("/")[0], tuple(int(x) for x in k.split("/")[1].split("x"))))


def at_best_table(archs: list[Architecture], key: str) -> str:
    """Each architecture's runs at its best value: the mean over seeds of the columns any of them has (the
    accuracies' slices among them)."""
    at_best = [s for a in archs for s in a.runs[a.pick.value]]
    columns = [c for c in (*AT_BEST, *slice_columns(at_best)) if any(s.get(c) is not None for s in at_best)]
    lines = [f"| architecture | best {key} | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for a in archs:
        cells = []
        for c in columns:
            values = [s[c] for s in a.runs[a.pick.value] if s.get(c) is not None]
            cells.append(fmt(float(statistics.mean(values)) if values else None, c))
        lines.append(f"| {a.label} | {value_text(a.pick.value)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
