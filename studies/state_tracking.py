"""Ours beside fla's layer on the same state-tracking data and steps, where a result here differs from a paper's.

    python studies/state_tracking.py --task s3 --householder 2 --allow-neg-eigval true --lrs 1e-3 --seeds 0,1,2 \
        --jobs 2 --out reports/st_side_by_side

Ours: DecoderLM as experiment=state_tracking builds it (configs/experiment/state_tracking.yaml: its layers, width,
heads, T, batch, steps and warm-up) with mixer=<mixer> and its options. The reference: deltaproduct -> fla's
GatedDeltaProductForCausalLM of the same shape at its own init, its Triton calls swapped for the same math in torch
(studies/side_by_side.py fla_gated_deltaproduct; fla comes with requirements-test.txt). Every model of one (lr, seed)
trains on the same batches (rows drawn from data=state_tracking's training split, configs/data/state_tracking.yaml,
with data.task=--task) in studies/side_by_side.py's loop (AdamW, warm-up then cosine to 0.1 lr, clipping at 1), one
thread and one fresh process per run (analysis/runner.py run_pending), and is scored as train.py scores it: the
accuracy of the running product by length band (data/state_tracking.py extra_eval: val/state_acc/<L>, L = 1, 2, 4
and 8 T) and their mean.

Writes to --out: runs.jsonl (one line per run; a rerun skips the runs it holds), table.md (each side at its best lr
by the mean over the bands, mean and min-max over seeds per band, the lr grid's means and a warning where a best sits
on the grid's edge) and state_acc_length.png (accuracy against length, each side at its best lr, the seeds' min-max
as a band).
"""
import argparse
import shlex
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from analysis.best import edge_text
from analysis.runner import read_runs, run_pending
from common.plots import SeriesStyle, legend_outside, mean_band, pyplot, save_figure
from data.state_tracking import TASKS, build_state_tracking
from model.config import PER_MIXER
from runs.plots import state_accuracy_axes
from studies.side_by_side import Shape, best_over_lr, ours, reference, train

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = {"deltaproduct": "fla_gated_deltaproduct"}  # mixer -> its reference; the mixers this study runs


def experiment() -> dict:
    """experiment=state_tracking's model and trainer sections."""
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "experiment" / "state_tracking.yaml"))
    return {"model": cfg["model"], "trainer": cfg["trainer"]}


def run(job: dict) -> dict:
    """Train one model on the job's task: the job with its mean accuracy curve (every eval_every steps) and its final
    accuracy per length band."""
    torch.set_num_threads(1)
    exp = experiment()
    model_cfg, trainer = exp["model"], exp["trainer"]
    data_cfg = OmegaConf.load(ROOT / "configs" / "data" / "state_tracking.yaml")
    data_cfg.task = job["task"]
    seq_len = trainer["seq_len"]
    data = build_state_tracking(data_cfg, seq_len=seq_len, seed=job["seed"])
    shape = Shape(layers=model_cfg["num_hidden_layers"], heads=model_cfg["num_attention_heads"],
                  seq_len=max(data.info["bands"]))
    options = {"num_householder": job["householder"], "allow_neg_eigval": job["allow_neg_eigval"]}
    torch.manual_seed(job["seed"])
    if job["impl"] == "ours":
        model = ours(job["mixer"], data.vocab_size, model_cfg["hidden_size"], PER_MIXER, shape, options)
    else:
        model = reference(job["impl"], data.vocab_size, model_cfg["hidden_size"], shape, options)
    g = torch.Generator().manual_seed(job["seed"])

    def batches(step):
        batch = data.train.batch(torch.randint(0, len(data.train), (trainer["batch_size"],), generator=g))
        return batch["input_ids"], batch["labels"]

    trained = train(model, model.parameters(), batches, job["steps"], job["lr"], trainer["warmup_steps"],
                    lambda m: data.extra_eval(m, torch.device("cpu")), job["eval_every"])
    last = trained["evals"][-1][1]
    return {**job, "acc": last["val/state_acc"], "curve": [[s, acc["val/state_acc"]] for s, acc in trained["evals"]],
            "bands": [[L, last[f"val/state_acc/{L}"]] for L in data.info["bands"]], "cpu_s": trained["cpu_s"],
            "params": trained["params"]}


KEY = ("impl", "mixer", "task", "householder", "allow_neg_eigval", "lr", "seed", "steps")


def job_key(job: dict) -> tuple:
    return tuple(job[k] for k in KEY)


def label(r: dict) -> str:
    return f"{r['task']}, {r['mixer']} n={r['householder']}" + (" + neg" if r["allow_neg_eigval"] else "")


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (task, mixer, options, side): the side at its best lr (side_by_side.best_over_lr on the mean over
    the bands), with each seed's bands there and the seed-mean of every lr of its grid."""
    rows = []
    for group in dict.fromkeys(label(r) for r in runs):
        for impl in dict.fromkeys(r["impl"] for r in runs if label(r) == group):
            mine = [r for r in runs if label(r) == group and r["impl"] == impl]
            best = best_over_lr(mine, "acc", True)
            grid = {lr: sum(r["acc"] for r in mine if r["lr"] == lr) / sum(r["lr"] == lr for r in mine)
                    for lr in best["lrs"]}
            rows.append({"group": group, "impl": impl, "best": best, "grid": grid,
                         "bands": [r["bands"] for r in mine if r["lr"] == best["lr"]]})
    return rows


def write_table(rows: list[dict], steps: int, path: Path, rerun: str) -> None:
    lengths = [L for L, _ in rows[0]["bands"][0]]
    lines = [f"State-tracking accuracy by length band after {steps} steps, each side at its best lr (by the mean over "
             "the bands); mean (min-max) over seeds.", "",
             "| task, mixer | side | lr grid (seed-mean over the bands) | best lr | seeds | "
             + " | ".join(str(L) for L in lengths) + " |", "|---|---|---|---|---|" + "---|" * len(lengths)]
    warnings = []
    for r in rows:
        b = r["best"]
        cells = []
        for i in range(len(lengths)):
            values = [seed_bands[i][1] for seed_bands in r["bands"]]
            mean = sum(values) / len(values)
            cells.append(f"{mean:.3f}" + (f" ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else ""))
        grid = ", ".join(f"{lr:g} {acc:.3f}" for lr, acc in r["grid"].items())
        lines.append(f"| {r['group']} | {r['impl']} | {grid} | {b['lr']:g} | {b['seeds']} | " + " | ".join(cells) + " |")
        if b["edge"]:
            warnings.append(f"{r['group']}, {r['impl']}: {edge_text('lr', b['lr'], b['lrs'], b['edge'])}; extend it: "
                            f"{rerun} --lrs {','.join(f'{v:g}' for v in b['beyond'])}")
    path.write_text("\n".join(lines + [f"\n**Warning: {w}**" for w in warnings]) + "\n")


def plot_bands(rows: list[dict], path: Path) -> None:
    """Accuracy against the length band, one panel per (task, mixer, options): each side at its best lr, the seeds'
    mean and min-max."""
    groups = list(dict.fromkeys(r["group"] for r in rows))
    style = SeriesStyle()
    fig, axes = pyplot().subplots(1, len(groups), figsize=(5 * len(groups), 3.6), squeeze=False)
    for ax, group in zip(axes[0], groups):
        for r in (r for r in rows if r["group"] == group):
            name = f"{r['impl']} (lr {r['best']['lr']:g})"
            style.add(name, r["impl"])
            mean_band(ax, [list(points) for points in zip(*[[tuple(p) for p in seed] for seed in r["bands"]])], name,
                      style(name))
        state_accuracy_axes(ax, [L for L, _ in rows[0]["bands"][0]], "length L (the band of prefix lengths (L/2, L])")
        ax.set_title(group, fontsize=9)
        ax.grid(alpha=0.3)
        legend_outside(ax, below=True)
    save_figure(fig, path, dpi=110)


def main(argv=None) -> int:
    trainer = experiment()["trainer"]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="s3", help=f"data.task, one of {', '.join(TASKS)}")
    p.add_argument("--mixer", default="deltaproduct", help=f"one of {', '.join(REFERENCE)}")
    p.add_argument("--householder", type=int, default=2, help="mixer.options.num_householder")
    p.add_argument("--allow-neg-eigval", default="true", choices=("true", "false"))
    p.add_argument("--lrs", default="1e-3")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=trainer["max_steps"])
    p.add_argument("--eval-every", type=int, default=trainer["eval_every"])
    p.add_argument("--no-reference", action="store_true", help="ours only")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, one thread each")
    p.add_argument("--out", default="reports/st_side_by_side")
    args = p.parse_args(argv)
    problems = [f"error: unknown {name} {value!r}; valid: {', '.join(valid)}"
                for name, value, valid in (("--task", args.task, TASKS), ("--mixer", args.mixer, REFERENCE))
                if value not in valid]
    if problems:
        sys.exit("\n".join(problems))
    base = {"mixer": args.mixer, "task": args.task, "householder": args.householder,
            "allow_neg_eigval": args.allow_neg_eigval == "true", "steps": args.steps, "eval_every": args.eval_every}
    impls = ["ours"] + ([] if args.no_reference else [REFERENCE[args.mixer]])
    jobs = [{**base, "impl": impl, "lr": float(lr), "seed": int(seed)}
            for seed in args.seeds.split(",") for lr in args.lrs.split(",") for impl in impls]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    run_pending(jobs, run, job_key, log, args.jobs,
                lambda r: f"{r['impl']} {label(r)} lr {r['lr']:g} seed {r['seed']}: "
                          + ", ".join(f"{L} {acc:.3f}" for L, acc in r["bands"]))
    runs = [r for r in read_runs(log) if r["steps"] == args.steps]
    rows = summarize(runs)
    rerun = (f"python studies/state_tracking.py --task {args.task} --mixer {args.mixer} --householder {args.householder} "
             f"--allow-neg-eigval {args.allow_neg_eigval} --seeds {args.seeds} --steps {args.steps} "
             f"--jobs {args.jobs} --out {shlex.quote(str(out))}")
    write_table(rows, args.steps, out / "table.md", rerun)
    plot_bands(rows, out / "state_acc_length.png")
    print((out / "table.md").read_text() + f"wrote table.md and state_acc_length.png in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
