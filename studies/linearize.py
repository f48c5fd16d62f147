"""The linearization study (docs/studies/linearize.md): a trained softmax teacher linearized into each student
architecture by train.py's experiment=linearize, against the same student trained from scratch for as many
tokens as the whole linearization, and for as many as the teacher. Every run is a train.py run dir under
--out; one whose final/ exists is not run again (rerun the command to continue a study; --report writes the
tables of the runs finished so far and starts none).

    python studies/linearize.py --teacher outputs/<softmax run> --out outputs/linearize_study \\
        --students derived_gdn,gdn,linear,hybrid --seeds 0,1 --lrs 3e-4,1e-3,3e-3 --jobs 2

Runs: for each student, experiment=linearize (its stage budgets, or --steps and --split) at every --lrs value,
and from scratch for --steps at every --scratch-lr-factors multiple of the mixer's default lr, on the first
seed, and the --teacher-tokens students from scratch for the teacher's steps at the default lr on the first seed
(the longest runs, started first); then the other seeds at the first seed's best lrs; with --splits, the first
student at its best lr with other stage splits, on the first seed.
Overrides after `--` go to every run (e.g. -- trainer.eval_batches=40).

Writes table.md (val bpb, mean (min-max) over seeds: the teacher; each student zero-shot (step 0), after
each stage and at the end, at its best linearization lr, an lr at the edge of --lrs flagged; from scratch),
the lr and split tables, and curves.png (val bpb against training tokens).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

from omegaconf import OmegaConf

from analysis.best import best_value
from analysis.runner import ROOT, finished, run_jobs
from common.plots import SeriesStyle, legend_outside, mean_band, pyplot, save_figure
from model.config import LMConfig
from runs.config import compose
from runs.metrics import read_metrics

# student name -> the train.py overrides that make it (gdn: value heads as wide as the teacher's, so that its
# v and o projections load). The hybrids keep softmax layers of derived GDN's 4: chosen by hand (hybrid: layer 1, the
# layer whose attention derived GDN fits worst zero-shot, studies/linearize_error.py --teacher; hybrid2: layers 1
# and 2) or by the KL gain of restoring each (hybrid_kl<m>: linearize.keep_softmax=auto:<m>, which cannot be trained
# from scratch: run those with --scratch-lr-factors none --teacher-tokens none)
STUDENTS = {
    "derived_gdn": ["mixer=derived_gdn"],
    "gdn": ["mixer=gdn", "mixer.options.expand_v=1"],
    "linear": ["mixer=linear"],
    "hybrid": ["mixer=derived_gdn", "model.mixer=[derived_gdn,softmax,derived_gdn,derived_gdn]"],
    "hybrid2": ["mixer=derived_gdn", "model.mixer=[derived_gdn,softmax,softmax,derived_gdn]"],
    "hybrid_kl1": ["mixer=derived_gdn", "linearize.keep_softmax=auto:1"],
    "hybrid_kl2": ["mixer=derived_gdn", "linearize.keep_softmax=auto:2"],
}
QUIET = ["logger=none", "trainer.sample_tokens=0"]


def run_dir(out: Path, kind: str, student: str, seed: int, lr: float, extra: str = "") -> Path:
    return out / f"{kind}_{student}{extra}_lr{lr:g}_s{seed}"


def default_lr(student: str, extra: list[str]) -> float:
    """trainer.lr of the student's train.py config: its mixer's tuned lr for the optimizer."""
    return float(compose([*STUDENTS[student], *extra]).trainer.lr)


def val_curve(run: Path) -> dict[int, float]:
    """{step: val bpb} of a run's evaluations (step 0: before any training)."""
    return {r["step"]: r["val/bpb"] for r in read_metrics(run) if "val/bpb" in r}


def launch(jobs: list[tuple[Path, list[str]]], parallel: int) -> None:
    """The train.py jobs not finished yet through analysis.runner, `parallel` at once; an interrupted one (its
    folder exists) is continued (resume=auto)."""
    todo = [{"name": d.name, "run_dir": str(d), "overrides": o + ["resume=auto"] * d.exists()}
            for d, o in jobs if not finished(d)]
    print(f"{len(jobs) - len(todo)} of {len(jobs)} runs done; running {len(todo)}, {parallel} at once", flush=True)
    run_jobs(todo, parallel=parallel)


def spread(values: list[float], seeds: int = 1) -> str:
    """mean (min-max) of `values`, saying so when fewer than `seeds` runs have finished."""
    if not values:
        return "-"
    mean = statistics.mean(values)
    shown = f"{mean:.4f}" if len(values) == 1 else f"{mean:.4f} ({min(values):.4f}-{max(values):.4f})"
    return shown + (f" [{len(values)} of {seeds} seeds]" if len(values) < seeds else "")


def best_lr(out: Path, kind: str, student: str, lrs: list[float], seeds: list[int]) -> tuple[float | None, bool]:
    """The lr whose finished `kind` runs (lin, scratch<steps>) of the student end with the lowest mean val bpb over
    `seeds` (analysis.best.best_value; None if none finished), and whether it is at the low or high edge of the
    grid (then it is not known to be a best)."""
    ends = {lr: [(s, end_bpb(d)) for s in seeds if finished(d := run_dir(out, kind, student, s, lr))] for lr in lrs}
    best = best_value({lr: runs for lr, runs in ends.items() if runs}, higher_is_better=False)
    return (None, False) if best is None else (best.value, best.edge in ("low edge", "high edge"))


def end_bpb(run: Path) -> float:
    curve = val_curve(run)
    return curve[max(curve)]


def best_scratch_lr(out: Path, student: str, lrs: list, seeds: list[int], steps: int):
    """The from-scratch lr with the lowest mean val bpb at the end (the first of the grid before any finished)."""
    return best_lr(out, f"scratch{steps}", student, lrs, seeds)[0] or lrs[0]


def softmax_layers(run: Path) -> list[int]:
    """The layers a finished run's student keeps softmax (its exported config's layer_mixers)."""
    kinds = LMConfig.from_pretrained(run / "final").layer_mixers
    return [i for i, kind in enumerate(kinds) if kind == "softmax"]


def stage_scores(run: Path) -> dict[str, float | None]:
    """Val bpb at step 0, at the last step of each stage that ran (as the run logged linearize/stage: a transfer
    stage with nothing to train is skipped) and at the end."""
    curve = val_curve(run)
    stages = {r["step"]: r["linearize/stage"] for r in read_metrics(run) if "linearize/stage" in r}
    last = {name: max((s for s, v in stages.items() if v == k), default=None) for k, name in enumerate(("transfer", "distill"))}
    return {"zero-shot": curve.get(0), "after transfer": curve.get(last["transfer"]),
            "after distill": curve.get(last["distill"]), "end": end_bpb(run)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="the softmax run dir (train.py's, with final/ and metrics.jsonl)")
    p.add_argument("--out", required=True)
    p.add_argument("--students", default="derived_gdn,gdn,linear,hybrid", help=f"some of {', '.join(STUDENTS)}")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--lrs", default="1e-3", help="linearization lrs (the best is reported)")
    p.add_argument("--scratch-lr-factors", default="1", help="from-scratch lrs, as factors of each student's default lr "
                                                              "('none': no from-scratch runs)")
    p.add_argument("--steps", type=int, help="steps of each linearization (default: experiment=linearize's)")
    p.add_argument("--split", help="T/D: transfer and distill steps, the rest finetune (default: experiment=linearize's)")
    p.add_argument("--splits", default="", help="other T/D splits, run for the first student at its best lr")
    p.add_argument("--teacher-tokens", help="students trained from scratch for the teacher's steps (default: all; "
                                            "'none': no such runs)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, each on cpu_count / jobs threads")
    p.add_argument("--report", action="store_true", help="start no run: the tables and plot of the runs finished so far")
    p.add_argument("extra", nargs="*", help="overrides for every run (after --)")
    args = p.parse_args()

    teacher, out = Path(args.teacher).resolve(), Path(args.out).resolve()
    students = args.students.split(",")
    long_students = students if args.teacher_tokens is None else [s for s in args.teacher_tokens.split(",") if s != "none"]
    if unknown := [s for s in students if s not in STUDENTS]:
        sys.exit(f"error: unknown --students {unknown}; valid: {', '.join(STUDENTS)}")
    if unknown := [s for s in long_students if s not in students]:
        sys.exit(f"error: --teacher-tokens {unknown} not in --students; valid: {', '.join(students)} or none")
    seeds = [int(s) for s in args.seeds.split(",")]
    lrs = [float(x) for x in args.lrs.split(",")]
    factors = [] if args.scratch_lr_factors == "none" else [float(x) for x in args.scratch_lr_factors.split(",")]
    experiment = OmegaConf.load(ROOT / "configs" / "experiment" / "linearize.yaml")
    steps = args.steps or experiment.trainer.max_steps
    transfer, distill = ((int(x) for x in args.split.split("/")) if args.split
                         else (experiment.linearize.transfer_steps, experiment.linearize.distill_steps))
    teacher_steps = OmegaConf.load(teacher / "config.yaml").trainer.max_steps
    out.mkdir(parents=True, exist_ok=True)

    def linearized(student, seed, lr, t=transfer, d=distill, extra=""):
        overrides = ["experiment=linearize", f"init_from={teacher}", *STUDENTS[student], f"seed={seed}", f"trainer.lr={lr}",
                     f"trainer.max_steps={steps}", f"linearize.transfer_steps={t}", f"linearize.distill_steps={d}",
                     *QUIET, *args.extra]
        return run_dir(out, "lin", student, seed, lr, extra), overrides

    def scratch(student, seed, lr, n):
        overrides = [*STUDENTS[student], f"seed={seed}", f"trainer.max_steps={n}", f"trainer.lr={lr}", *QUIET, *args.extra]
        return run_dir(out, f"scratch{n}", student, seed, lr), overrides

    scratch_lrs = {st: [f * default_lr(st, args.extra) for f in factors] for st in students}
    splits = [tuple(int(x) for x in sp.split("/")) for sp in args.splits.split(",") if sp]
    if not args.report:
        # the longest runs first, so that the short ones fill the other jobs meanwhile; the lr grids on the first
        # seed; the other seeds at its best lr
        launch([scratch(st, seeds[0], default_lr(st, args.extra), teacher_steps) for st in long_students]
               + [linearized(st, seeds[0], lr) for st in students for lr in lrs]
               + [scratch(st, seeds[0], lr, steps) for st in students for lr in scratch_lrs[st]], args.jobs)
        launch([linearized(st, s, best_lr(out, "lin", st, lrs, seeds[:1])[0]) for st in students for s in seeds[1:]]
               + [scratch(st, s, best_scratch_lr(out, st, scratch_lrs[st], seeds[:1], steps), steps)
                  for st in students if scratch_lrs[st] for s in seeds[1:]], args.jobs)
        if splits:  # at the first student's best lr, which the runs above found
            lr, _ = best_lr(out, "lin", students[0], lrs, seeds[:1])
            launch([linearized(students[0], seeds[0], lr, t, d, f"_split{t}-{d}") for t, d in splits], args.jobs)

    report = report_tables(out, teacher, students, seeds, lrs, scratch_lrs, steps, transfer, distill, teacher_steps,
                           splits, args.extra)
    (out / "table.md").write_text(report + "\n")
    print(report)
    plot_curves(out, teacher, students, seeds, lrs, scratch_lrs, steps, teacher_steps, args.extra, out / "curves.png")
    print(f"\nwrote {out / 'table.md'} and {out / 'curves.png'}")


def report_tables(out, teacher, students, seeds, lrs, scratch_lrs, steps, transfer, distill, teacher_steps,
                  splits, extra) -> str:
    teacher_bpb = val_curve(teacher)[max(val_curve(teacher))]
    finetune = steps - transfer - distill
    lines = [f"Teacher: {teacher} ({teacher_steps} steps), val bpb {teacher_bpb:.4f}. Each linearization: {steps} steps "
             f"({100 * steps / teacher_steps:.0f}% of the teacher's tokens): transfer {transfer}, distill {distill}, "
             f"finetune {finetune}. Val bpb, mean (min-max) over seeds {seeds}, each at the lr that was best on seed {seeds[0]}.", "",
             "| student | lr | zero-shot | after transfer | after distill | linearized | gap to teacher | "
             f"scratch, {steps} steps (lr) | scratch, {teacher_steps} steps (seed {seeds[0]}) |", "|---" * 9 + "|"]
    lr_rows, kept_rows = [], []
    for student in students:
        lr, edge = best_lr(out, "lin", student, lrs, seeds[:1])  # chosen on the grid's seed
        if lr is None:
            continue
        runs = [d for s in seeds if finished(d := run_dir(out, "lin", student, s, lr))]
        scores = [stage_scores(d) for d in runs]
        col = {k: spread([sc[k] for sc in scores if sc[k] is not None], len(seeds)) for k in scores[0]}
        gap = spread([sc["end"] - teacher_bpb for sc in scores], len(seeds))
        scratch_lr, scratch_at_edge = best_lr(out, f"scratch{steps}", student, scratch_lrs[student], seeds[:1])
        scratch_lr = scratch_lr or (scratch_lrs[student] or [None])[0]
        equal = [end_bpb(d) for s in seeds if scratch_lr is not None
                 and finished(d := run_dir(out, f"scratch{steps}", student, s, scratch_lr))]
        long = [end_bpb(d) for d in [run_dir(out, f"scratch{teacher_steps}", student, seeds[0], default_lr(student, extra))]
                if finished(d)]
        shown_lr = f"{lr:g}" + (" (edge of grid)" if edge else "")
        scratch = "-" if scratch_lr is None else (f"{spread(equal, len(seeds))} ({scratch_lr:g}"
                                                  + " (edge of grid)" * scratch_at_edge + ")")
        lines.append(f"| {student} | {shown_lr} | {col['zero-shot']} | {col['after transfer']} | {col['after distill']} | "
                     f"{col['end']} | {gap} | {scratch} | {spread(long)} |")
        if kept := {s: softmax_layers(d) for s in seeds if finished(d := run_dir(out, "lin", student, s, lr))}:
            if any(kept.values()):
                kept_rows.append(f"{student}: " + ", ".join(f"seed {s}: {layers}" for s, layers in kept.items()))
        for x in lrs:
            ends = [end_bpb(d) for s in seeds if finished(d := run_dir(out, "lin", student, s, x))]
            lr_rows.append(f"| {student} | {x:g} | {spread(ends)} |")
    if kept_rows:
        lines += ["", "Softmax layers each hybrid kept (at its best lr):", "", *(f"- {row}" for row in kept_rows)]
    lines += ["", "Linearization at each lr (val bpb at the end):", "", "| student | lr | val bpb |", "|---|---|---|", *lr_rows]
    if splits and (lr := best_lr(out, "lin", students[0], lrs, seeds[:1])[0]) is not None:
        lines += ["", f"Stage splits of {students[0]} at lr {lr:g} ({steps} steps each, seed {seeds[0]}):", "",
                  "| transfer / distill / finetune | after transfer | after distill | end |", "|---|---|---|---|"]
        for t, d in [(transfer, distill), *splits]:
            extra = "" if (t, d) == (transfer, distill) else f"_split{t}-{d}"
            scores = [stage_scores(r) for r in [run_dir(out, "lin", students[0], seeds[0], lr, extra)] if finished(r)]
            col = {k: spread([sc[k] for sc in scores if sc[k] is not None]) for k in ("after transfer", "after distill", "end")}
            lines.append(f"| {t} / {d} / {steps - t - d} | {col['after transfer']} | {col['after distill']} | {col['end']} |")
    return "\n".join(lines)


def plot_curves(out, teacher, students, seeds, lrs, scratch_lrs, steps, teacher_steps, extra, path: Path) -> None:
    """Per student: val bpb against training tokens of the linearization (its tokens on top of the teacher's), of
    from-scratch training and of the teacher; the mean over seeds with their min-max as a band, each kind of run in
    its colour in every panel."""
    import matplotlib.ticker

    tokens_per_step = json.loads((teacher / "run_info.json").read_text())["seq_len"] * OmegaConf.load(
        teacher / "config.yaml").trainer.batch_size

    def at_steps(dirs, offset=0):
        """[the seeds' (tokens, val bpb) at each step all of them evaluated]."""
        curves = [val_curve(d) for d in dirs if finished(d)]
        common = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        return [[(offset + s * tokens_per_step, c[s]) for c in curves] for s in common]

    kinds = {"linearized": "linearized", f"from scratch, {steps} steps": "scratch",
             f"from scratch, {teacher_steps} steps": "scratch"}
    style = SeriesStyle([("teacher (softmax)", "teacher"), *kinds.items()])
    fig, axes = pyplot().subplots(1, len(students), figsize=(4.2 * len(students), 3.6), sharey=True, squeeze=False)
    t_curve = val_curve(teacher)
    shown = [min(t_curve.values())]  # the values the y range must show: every curve's end, the linearized starts
    for ax, student in zip(axes[0], students):
        lr, _ = best_lr(out, "lin", student, lrs, seeds[:1])
        if lr is None:
            continue
        ax.plot([s * tokens_per_step for s in t_curve], list(t_curve.values()), label="teacher (softmax)",
                **{**style("teacher (softmax)"), "marker": None})
        points = at_steps([run_dir(out, "lin", student, s, lr) for s in seeds], teacher_steps * tokens_per_step)
        mean_band(ax, points, f"linearized (lr {lr:g})", {**style("linearized"), "marker": "."})
        shown += [statistics.mean(y for _, y in p) for p in points]
        for n in (steps, teacher_steps):
            grid = scratch_lrs[student] if n == steps else [default_lr(student, extra)]  # teacher's tokens: default lr
            if not grid:
                continue
            label = f"from scratch, {n} steps"
            points = at_steps([run_dir(out, f"scratch{n}", student, s, best_scratch_lr(out, student, grid, seeds[:1], n))
                               for s in seeds])
            mean_band(ax, points, f"{student} {label}", style(label), ms=3)
            shown += [statistics.mean(y for _, y in p) for p in points[-1:]]
        ax.set(title=student, xlabel="training tokens (linearized: after the teacher's)", xscale="log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # the decades only: minor labels overlap
        ax.grid(True, alpha=0.3)
        legend_outside(ax, below=True)
    axes[0][0].set_ylabel("val bits per byte")
    axes[0][0].set_ylim(min(shown) - 0.05, max(shown) + 0.3)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
