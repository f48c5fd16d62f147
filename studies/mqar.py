"""Each mixer next to its reference implementation on the same MQAR data and steps, over lrs and seeds.

    python studies/mqar.py --widths 64,128 --seeds 0 --steps 500 --jobs 2 --out reports/mqar_side_by_side

Ours: DecoderLM as experiment=mqar builds it (2 layers, 2 heads, dense SwiGLU FFN, each block's
defaults) with mixer=<mixer> and model.parametrization=<each of --parametrizations>. The references,
transformers' own models with their own init, shaped like ours: softmax -> LlamaForCausalLM; gdn and
derived_gdn (a gated delta rule) -> Qwen3-Next with every layer a Gated DeltaNet layer and a dense MLP;
mamba2 -> Mamba2ForCausalLM (mixer-only layers, as mamba_ssm); linear -> fla's LinearAttentionForCausalLM
(transformers has no linear attention; fla comes with requirements-test.txt on a CPU, requirements-gpu.txt
on CUDA, and its Triton calls are swapped for torch: side_by_side.fla_linear_attention). Every model of one
(width, lr, seed) trains on the same batches of experiment=mqar's data (configs/data/mqar.yaml,
seq_len 64, batch 64) with the same AdamW (betas 0.9, 0.95, weight decay 0.1), 50 warm-up steps then
cosine to 0.1 lr, clipping at 1, one thread and one fresh process per run: the models, the training loop and the
lr picker are studies/side_by_side.py's, the process pool analysis/runner.py's run_pending.

Writes to --out: runs.jsonl (one line per run, with its accuracy curve; a rerun skips the runs it
holds, so a second call with --seeds 1 and one lr per mixer adds a seed at the best lrs), table.md
(per mixer and width: each side at its best lr, mean and min-max over seeds, and ours / reference),
curves.png (accuracy against steps at the best lr, ours and the reference) and, as zoology plots them
but at this step budget, mqar_state.png and mqar_width.png (ours at the best lr against decode-state
size and against d_model, min-max over seeds as error bars). The table and plots read every run in
runs.jsonl at --steps for the widths, mixers and parametrizations asked for.
"""
import argparse
import importlib.util
import shlex
import sys
from pathlib import Path

import torch

from analysis.best import edge_text
from analysis.plots import style_mqar_axes
from analysis.runner import read_runs, run_pending
from analysis.summary import decode_state_numbers
from common.plots import SeriesStyle, legend_outside, mean_band, pyplot, save_figure
from model.config import PARAMETRIZATIONS, PER_MIXER
from studies.side_by_side import Shape, best_over_lr, ours, reference, train

ROOT = Path(__file__).resolve().parents[1]

# mixer -> its reference implementation; the mixers this study runs are those that have one
REFERENCE = {"softmax": "llama", "gdn": "qwen3_next_gdn", "derived_gdn": "qwen3_next_gdn", "mamba2": "mamba2",
             "linear": "fla_linear_attn"}
MIXERS = tuple(REFERENCE)
SHAPE, BATCH, WARMUP = Shape(layers=2, heads=2, seq_len=64), 64, 50


def run(job: dict) -> dict:
    """Train one model on MQAR: the job with its accuracy curve (every eval_every steps) and final per-slice accuracy."""
    torch.set_num_threads(1)
    data = mqar_data(job["seed"])
    torch.manual_seed(job["seed"])
    if job["impl"] == "ours":
        model = ours(job["mixer"], data.vocab_size, job["d"], job["parametrization"], SHAPE)
    else:
        model = reference(job["impl"], data.vocab_size, job["d"], SHAPE)
    g = torch.Generator().manual_seed(job["seed"])

    def batches(step):
        batch = data.train.batch(torch.randint(0, len(data.train), (BATCH,), generator=g))
        return batch["input_ids"], batch["labels"]

    trained = train(model, model.parameters(), batches, job["steps"], job["lr"], WARMUP,
                    lambda m: data.extra_eval(m, torch.device("cpu")), job["eval_every"])
    curve = [[step, acc["val/mqar_acc"]] for step, acc in trained["evals"]]
    last = trained["evals"][-1][1]
    return {**job, "acc": curve[-1][1], "slices": {k.split("/")[-1]: v for k, v in last.items() if k.count("/") == 2},
            "curve": curve, "cpu_s": trained["cpu_s"], "params": trained["params"]}


def mqar_data(seed: int):
    from omegaconf import OmegaConf

    from data.mqar import build_mqar

    return build_mqar(OmegaConf.load(ROOT / "configs" / "data" / "mqar.yaml"), seq_len=SHAPE.seq_len, seed=seed)


def job_key(job: dict) -> tuple:
    return tuple(job[k] for k in ("impl", "mixer", "parametrization", "d", "lr", "seed", "steps"))


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (mixer, width, our parametrization): ours and the reference, each at its best lr."""
    rows = []
    for d in sorted({r["d"] for r in runs}):
        for mixer in [m for m in MIXERS if any(r["mixer"] == m for r in runs)]:
            ref = best_over_lr([r for r in runs if r["impl"] == REFERENCE.get(mixer) and r["d"] == d], "acc", True)
            for par in sorted({r["parametrization"] for r in runs if r["mixer"] == mixer}):
                mine = best_over_lr([r for r in runs if r["impl"] == "ours" and r["mixer"] == mixer and r["d"] == d
                                     and r["parametrization"] == par], "acc", True)
                if mine:
                    rows.append({"mixer": mixer, "d": d, "parametrization": par, "ours": mine,
                                 "reference": REFERENCE.get(mixer) if ref else None, "ref": ref,
                                 "ratio": mine["mean"] / ref["mean"] if ref and ref["mean"] else None})
    return rows


def extension(row: dict, side: str, rerun: str) -> str | None:
    """A line for a side (ours or ref) whose best lr is at the edge of its lrs: where, and the command that adds the
    lrs beyond it (rerun: this script with the same --seeds, --steps and --out); None when the best is inside."""
    best = row[side]
    if not best or not best["edge"]:
        return None
    option = "--softmax-lrs" if row["mixer"] == "softmax" else "--lrs"  # ours and Llama on softmax's lrs
    command = f"{rerun} --mixers {row['mixer']} --widths {row['d']} {option} {','.join(f'{v:g}' for v in best['beyond'])}"
    who = f"ours ({row['parametrization']})" if side == "ours" else row["reference"]
    if side == "ours":
        command += f" --parametrizations {row['parametrization']} --no-reference"
    return f"{row['mixer']} d {row['d']}, {who}: {edge_text('lr', best['lr'], best['lrs'], best['edge'])}; extend it: {command}"


def write_table(rows: list[dict], steps: int, path: Path, rerun: str) -> None:
    """table.md: each row's best lrs, an edge flag after a best at the edge of the lrs tried (or the only one), and
    under the table, in bold, each flagged side's extension (see extension)."""
    def cell(b):
        return f"{b['mean']:.3f} ({b['lo']:.3f}-{b['hi']:.3f}) at {b['lr']:g}" + (f" [{b['edge']}]" if b["edge"] else "")

    lines = [f"MQAR accuracy after {steps} steps, each side at its best lr; mean (min-max) over seeds.", "",
             "| mixer | d | ours: parametrization | ours | reference | reference's | ours / reference |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"  # no reference, or one that never recalled
        ref = (r["reference"], cell(r["ref"]), ratio) if r["ref"] else ("-", "-", "-")
        lines.append(f"| {r['mixer']} | {r['d']} | {r['parametrization']} | {cell(r['ours'])} | {ref[0]} | {ref[1]} | {ref[2]} |")
    seeds = sorted({b[k]["seeds"] for b in rows for k in ("ours", "ref") if b[k]})
    lrs = sorted({lr for b in rows for k in ("ours", "ref") if b[k] for lr in b[k]["lrs"]})
    lines += ["", f"lrs tried: {', '.join(f'{lr:g}' for lr in lrs)}; seeds per point: {', '.join(map(str, seeds))}."]
    flagged = dict.fromkeys(line for r in rows for side in ("ours", "ref") if (line := extension(r, side, rerun)))
    lines += [f"\n**Warning: {line}**" for line in flagged]
    path.write_text("\n".join(lines) + "\n")


def plot_curves(rows: list[dict], path: Path) -> None:
    """Accuracy against steps, one panel per (mixer, width): ours per parametrization and the reference, each at
    its best lr (in the panel's title), the mean over seeds with the min-max band; one colour per mixer, a line
    style per side; each row's legend right of its last panel."""
    mixers = list(dict.fromkeys(r["mixer"] for r in rows))
    widths = sorted({r["d"] for r in rows})
    style = SeriesStyle()
    fig, axes = pyplot().subplots(len(mixers), len(widths), figsize=(4.2 * len(widths), 2.8 * len(mixers)),
                                  squeeze=False, sharex=True, sharey=True)
    for i, mixer in enumerate(mixers):
        for j, d in enumerate(widths):
            ax = axes[i][j]
            panel = [r for r in rows if r["mixer"] == mixer and r["d"] == d]
            sides = [(f"ours, {r['parametrization']}", r["ours"]) for r in panel]
            if panel and panel[0]["ref"]:
                sides.append((f"{panel[0]['reference']} (reference)", panel[0]["ref"]))
            for label, best in sides:
                style.add(label, mixer)
                at_step = zip(*[[tuple(point) for point in curve] for curve in best["curves"]])
                mean_band(ax, [list(points) for points in at_step], label, {**style(label), "marker": None})
            lrs = "; ".join(f"{label.removeprefix('ours, ').removesuffix(' (reference)')} {best['lr']:g}"
                            for label, best in sides)
            ax.set_title(f"{mixer}, d {d} (best lr: {lrs})", fontsize=8)
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            if i == len(mixers) - 1:
                ax.set_xlabel("step")
            if j == 0:
                ax.set_ylabel("MQAR accuracy")
        legend_outside(axes[i][-1])
    save_figure(fig, path, dpi=110)


def plot_zoology(rows: list[dict], out: Path) -> list[Path]:
    """Ours at the best lr per (mixer, width): accuracy against decode-state numbers and against d_model, the mean
    over seeds with their min-max as a band, one colour per mixer."""
    style, written = SeriesStyle(), []
    one = len({r["parametrization"] for r in rows}) == 1
    for key, name, xlabel in (("state", "mqar_state.png", "decode state per sequence (numbers, T = 64)"),
                              ("d", "mqar_width.png", "d_model")):
        fig, ax = pyplot().subplots(figsize=(6.5, 4.5))
        for (mixer, par) in dict.fromkeys((r["mixer"], r["parametrization"]) for r in rows):
            label = mixer if one else f"{mixer}, {par}"
            style.add(label, mixer)
            points = []
            for r in (r for r in rows if r["mixer"] == mixer and r["parametrization"] == par):
                x = r["d"] if key == "d" else decode_state_numbers(ours(mixer, 64, r["d"], par, SHAPE), SHAPE.seq_len)
                points.append([(x, curve[-1][1]) for curve in r["ours"]["curves"]])  # each seed's final accuracy
            mean_band(ax, points, label, style(label))
        style_mqar_axes(ax, xlabel)
        written.append(save_figure(fig, out / name, dpi=110))
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixers", default=",".join(MIXERS), help=f"comma-separated, from {', '.join(MIXERS)}")
    p.add_argument("--widths", default="64,128")
    p.add_argument("--lrs", default="3e-3,1e-2", help="for every model but softmax attention's")
    p.add_argument("--softmax-lrs", default="1e-3,3e-3", help="for ours and Llama (softmax attention wants lower ones)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--parametrizations", default=PER_MIXER,
                   help=f"ours, comma-separated (model.parametrization), from {', '.join([PER_MIXER, *PARAMETRIZATIONS])}")
    p.add_argument("--no-reference", action="store_true", help="ours only")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, one thread each")
    p.add_argument("--out", default="reports/mqar_side_by_side")
    args = p.parse_args(argv)
    mixers, pars = args.mixers.split(","), args.parametrizations.split(",")
    for name, given, valid in (("--mixers", mixers, MIXERS), ("--parametrizations", pars, [PER_MIXER, *PARAMETRIZATIONS])):
        bad = [m for m in given if m not in valid]
        if bad:
            sys.exit(f"error: unknown {name} {bad[0]!r}; valid: {', '.join(valid)}")
    if "linear" in mixers and not args.no_reference and importlib.util.find_spec("fla") is None:
        sys.exit("error: linear's reference is fla's LinearAttention model and fla is not installed: pip install -r "
                 "requirements-test.txt (CPU) or -r requirements-gpu.txt (CUDA), or pass --no-reference")
    widths, seeds = [int(v) for v in args.widths.split(",")], [int(v) for v in args.seeds.split(",")]
    lrs = {m: [float(v) for v in (args.softmax_lrs if m == "softmax" else args.lrs).split(",")] for m in mixers}
    base = {"steps": args.steps, "eval_every": args.eval_every}
    jobs = {}
    for d in widths:
        for seed in seeds:
            for mixer in mixers:
                for lr in lrs[mixer]:
                    for par in pars:
                        job = {"impl": "ours", "mixer": mixer, "parametrization": par, "d": d, "lr": lr, "seed": seed, **base}
                        jobs[job_key(job)] = job
                    if mixer in REFERENCE and not args.no_reference:
                        impl = REFERENCE[mixer]
                        job = {"impl": impl, "mixer": impl, "parametrization": "own", "d": d, "lr": lr, "seed": seed, **base}
                        jobs[job_key(job)] = job
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    run_pending(list(jobs.values()), run, job_key, log, args.jobs,
                lambda r: f"{r['impl']} {r['mixer']} {r['parametrization']} d{r['d']} lr {r['lr']:g} seed {r['seed']}: "
                          f"acc {r['acc']:.3f}")
    runs = [r for r in read_runs(log) if r["steps"] == args.steps and r["d"] in widths and r["parametrization"] in [*pars, "own"]
            and (r["mixer"] in mixers or r["impl"] in [REFERENCE.get(m) for m in mixers])]
    rows = summarize(runs)
    rerun = (f"python studies/mqar.py --seeds {args.seeds} --steps {args.steps} --eval-every {args.eval_every} "
             f"--jobs {args.jobs} --out {shlex.quote(str(out))}")
    write_table(rows, args.steps, out / "table.md", rerun)
    plot_curves(rows, out / "curves.png")
    plot_zoology(rows, out)
    print((out / "table.md").read_text() + f"wrote table.md, curves.png, mqar_state.png and mqar_width.png in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
