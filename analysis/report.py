"""compare(): the report over any runs (docs/comparing.md): discover() finds them (local run dirs, W&B offline
folders), then compare.md, compare.csv, best_over.json under --best-over, and the figures, with one SeriesStyle
for all of them."""
import csv
import json
import re
from pathlib import Path

from analysis.best import EDGE_TAG, best_over_sections, edge_report, group_architectures, slice_columns
from analysis.plots import (best_series, plot_best_over, plot_curves, plot_moe_load, plot_mqar, plot_state_accuracy,
                            plot_throughput, series_of)
from analysis.runs import Run, cfg_get, read_local
from analysis.summary import COLUMNS, budget_line, markdown_table, summarize_run
from analysis.wandb_runs import read_wandb_api, read_wandb_offline, set_tag
from common.plots import SeriesStyle
from evaluation.suites import SUITES, EvalPoint


def natural_key(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def discover(paths: list[Path]) -> tuple[list[Run], list[str]]:
    """Runs under the given paths (a run dir's own wandb/ folder is not read twice; the offline
    folders of one W&B run id are read as one run)."""
    runs, notes, seen, offline = [], [], set(), {}

    def visit(p: Path):
        if p.resolve() in seen:
            return
        seen.add(p.resolve())
        if (p / "metrics.jsonl").exists():
            runs.append(read_local(p))
        elif list(p.glob("run-*.wandb")):
            run_id = next(p.glob("run-*.wandb")).stem.removeprefix("run-")
            if run_id not in offline:
                offline[run_id] = []
                runs.append(run_id)  # a placeholder, read once all its folders are found
            offline[run_id].append(p)
        elif p.is_dir():
            children = [c for c in p.iterdir() if c.is_dir() and not c.name.startswith(".")]
            for child in sorted(children, key=natural_key):  # sweep jobs in job order: 2_x before 10_x
                visit(child)

    for p in paths:
        if not p.exists():
            notes.append(f"{p}: does not exist")
            continue
        before = len(runs)
        visit(p)
        if len(runs) == before:
            notes.append(f"{p}: no runs found (no metrics.jsonl or run-*.wandb)")
    runs = [read_wandb_offline(sorted(offline[r], key=lambda f: f.name)) if isinstance(r, str) else r for r in runs]
    names = [r.name for r in runs]
    for r in runs:  # jobs of different sweeps share names (0_0): such a local run is named <sweep folder>/<job>
        if names.count(r.name) > 1 and Path(r.source).is_dir():
            r.name = f"{Path(r.source).parent.name}/{r.name}"
    return runs, notes


def eval_points(runs: list[Run], summaries: list[dict], archs: list, key: str | None) -> list[EvalPoint]:
    """Under --best-over each architecture at its best value (its seeds' reports averaged), else each run."""
    if archs:
        return [EvalPoint(a.label, str(a.summary["mixer"]), [r.report for r in a.members[a.pick.value] if r.report], key)
                for a in archs]
    return [EvalPoint(s["run"], str(s["mixer"]), [run.report] if run.report else []) for run, s in zip(runs, summaries)]


def compare(paths: list[Path], out: Path, wandb_path: str | None = None, best_over: str | None = None) -> dict:
    runs, notes = discover(paths)
    if wandb_path:
        runs += read_wandb_api(wandb_path)
    skipped = [r for r in runs if not r.complete or not any("val/loss" in row for row in r.rows)]
    for r in skipped:
        notes.append(f"skipped {r.name} ({r.source}): {r.note or 'no val metrics'}")
    runs = [r for r in runs if r not in skipped]
    missing = [r.name for r in runs if best_over and cfg_get(r.config, best_over) is None]
    if missing:
        raise ValueError(f"--best-over {best_over}: run {missing[0]} has no {best_over} in its config")
    summaries = [summarize_run(r) for r in runs]
    out.mkdir(parents=True, exist_ok=True)
    archs = group_architectures(runs, summaries, best_over) if best_over and runs else []
    for a in archs:
        for at_value in a.runs.values():
            for s in at_value:
                s.update(architecture=a.label, edge=a.pick.edge)
    slice_cols = slice_columns(summaries)
    eval_cols = sorted({k for s in summaries for k in s if k.startswith("eval/")})
    columns = COLUMNS[:-2] + slice_cols + eval_cols + (["architecture", "edge"] if archs else []) + COLUMNS[-2:]
    with (out / "compare.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(summaries)
    shown = [c for c in columns if c not in ("source", "budget", "architecture", "edge")
             and any(s.get(c) is not None for s in summaries)]
    series = best_series(archs, best_over) if archs else series_of(list(zip(runs, summaries)))
    # in label order: a mixer's variants get their line styles by name, alike in every report (False before True)
    style = SeriesStyle(sorted((x.label, x.mixer) for x in series) + [(a.label, str(a.summary["mixer"])) for a in archs]
                        + [(s["run"], str(s["mixer"])) for s in summaries])
    mqar_points = summaries
    if archs:  # the MQAR plots show each architecture at its best value
        mqar_points = [{**a.summary, "mqar_acc": a.means()[a.pick.value] if a.score == "mqar_acc" else None} for a in archs]
        (out / "best_over.json").write_text(json.dumps(edge_report(archs, best_over), indent=1))
        notes += set_tag([(run, a.pick.edge is not None and value == a.pick.value) for a in archs
                          for value, members in a.members.items() for run in members], EDGE_TAG)
    plots = (plot_curves(series, out, style) + plot_throughput(summaries, out, style) + plot_moe_load(runs, summaries, out)
             + plot_mqar(mqar_points, out, style) + plot_state_accuracy(
                 [(a.label, a.runs[a.pick.value]) for a in archs] or [(s["run"], [s]) for s in summaries], out, style)
             ) if runs else []
    md = [f"# Comparison of {len(runs)} run(s)", "", f"Budget: {budget_line([r.config for r in runs])}.", ""]
    warnings = []
    if archs:
        sections, warnings = best_over_sections(archs, best_over)
        md += [*sections, "## Every run", ""]
        plots += plot_best_over(archs, best_over, out, style)
    md += [markdown_table(summaries, shown) if runs else "(no complete runs)", "",
           "params: total (active per token); train_flops: tokens x train FLOPs per token; tokens/s and MFU: median "
           "over training logs after the first; val metrics at the last evaluation; wall_s: training wall-clock; "
           "state_size: decode-cache numbers per sequence at trainer.seq_len.", ""]
    points = eval_points(runs, summaries, archs, best_over)
    for name in SUITES.names():  # each eval suite's tables and figures (evaluation/suites/<name>.py compare)
        figures, lines, suite_notes = SUITES.get(name)().compare(points, out, style)
        plots, md, notes = plots + figures, md + lines, notes + suite_notes
    md += [f"![{p.stem}]({p.relative_to(out)})" for p in plots]
    if notes:
        md += ["", "## Notes", *[f"- {n}" for n in notes]]
    (out / "compare.md").write_text("\n".join(md) + "\n")
    return {"summaries": summaries, "architectures": archs, "notes": notes, "plots": plots,
            "warnings": warnings, "markdown": "\n".join(md)}
