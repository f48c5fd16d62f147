"""Our GDN LM next to transformers' Qwen3-Next GDN layers on the default corpus, over lrs and seeds, and our GDN
with one of the reference's init choices at a time, to name the difference that costs.

    python studies/gdn_language.py --lrs 1e-3,2e-3,4e-3,8e-3 --seeds 0,1 --jobs 2 --out reports/gdn_language

Both models are the default run's shape (model=tiny: d 256, 4 layers, 4 heads, FFN 768, every layer GDN with its
defaults: head dim 64, value expansion 2, conv 4) and train on the same batches of the default corpus (data=stdlib,
seq_len 256, batch 8, one sequence per row as the reference cannot mask documents) with the same AdamW (betas 0.9,
0.95; weight decay 0.1 on matrices only, the library's rule, training/optim.py param_groups), warm-up 10 steps,
cosine to 0.1 lr, clipping at 1; val bpb over the first 160 val sequences (the trainer's 20 batches of 8), with
the scorer the trainer uses. One thread and one fresh process per run. The models, the training loop and the lr
picker are studies/side_by_side.py's, the process pool analysis/runner.py's run_pending.

Ours, by --variants (VARIANTS): `default` the library's start (parametrization tied, gdn's defaults: short-conv
kernels N(0, 0.02) as both references) and changes to it: `conv_uniform` (the short-conv kernels at
nn.Conv1d's U(+-1/sqrt(4)), conv_init=uniform, the library's default before), `conv_qk_uniform` and `conv_v_uniform`
(only those convs' kernels), `dt_one` (softplus(dt_bias) at softplus(1), Qwen3-Next's dt_bias=1),
`conv_uniform_dt_one` (both), `untied` (fla's parametrization: own lm_head), `llama` (Llama's: own lm_head and every
residual write, o_proj and the FFN's down_proj, at N(0, 0.02) without 1/sqrt(2L), as Qwen3-Next), `o_unscaled`
(o_proj alone at N(0, 0.02)), `reference_init` (llama + dt_one: Qwen3-Next's start). Zero-centred
norms make no difference here: AdamW does not decay norm weights under the library's rule, and its update does not
see the offset.

Writes to --out: runs.jsonl (one line per run with its val curve; a rerun skips the runs it holds), table.md (every
side in runs.jsonl at --steps, each at its best lr, mean and min-max over seeds, an edge flag where the best is at
the edge of the lrs tried) and curves.png (val bpb against steps at each side's best lr).
"""
import argparse
import shlex
import sys
from functools import partial
from pathlib import Path

import torch

from analysis.best import edge_text
from analysis.runner import read_runs, run_pending
from common.plots import SeriesStyle, legend_outside, mean_band, pyplot, save_figure
from model.config import PARAMETRIZATIONS
from model.layers import init_fan_in_uniform_
from studies.side_by_side import Shape, best_over_lr, ours, reference, train

ROOT = Path(__file__).resolve().parents[1]
D, SHAPE, BATCH, WARMUP, EVAL_SEQUENCES = 256, Shape(layers=4, heads=4, seq_len=256, intermediate_size=768), 8, 10, 160
REFERENCE = "qwen3_next_gdn"


def dt_one(mixer) -> None:
    mixer.dt_bias.data.fill_(1.0)


def conv_uniform(mixer, convs: str = "qkv") -> None:
    """Those short convs' kernels at nn.Conv1d's U(+-1/sqrt(conv_size)), conv_init=uniform's draw."""
    for name in convs:
        init_fan_in_uniform_(getattr(mixer, f"{name}_conv").conv.weight, mixer.conv_size)


def o_unscaled(mixer) -> None:
    mixer.o_proj.weight.data.normal_(0.0, mixer.init_std)


# variant -> (parametrization, edits of each GDN mixer after the model's init)
VARIANTS = {"default": ("tied", ()), "conv_uniform": ("tied", (conv_uniform,)),
            "conv_qk_uniform": ("tied", (partial(conv_uniform, convs="qk"),)),
            "conv_v_uniform": ("tied", (partial(conv_uniform, convs="v"),)),
            "dt_one": ("tied", (dt_one,)), "conv_uniform_dt_one": ("tied", (conv_uniform, dt_one)),
            "untied": ("fla", ()), "llama": ("llama", ()), "o_unscaled": ("tied", (o_unscaled,)),
            "reference_init": ("llama", (dt_one,))}
assert all(p in PARAMETRIZATIONS for p, _ in VARIANTS.values())


class Logits(torch.nn.Module):
    """The reference as the scorer calls models: logits and no aux metrics."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids=None):
        out = self.model(input_ids=input_ids)
        out.aux_metrics = None
        return out


def corpus(seed: int, max_documents: int | None):
    """data=stdlib as the default run reads it, one sequence per row, from the first max_documents files (None: all)."""
    from omegaconf import OmegaConf

    from data import build_data

    cfg = OmegaConf.load(ROOT / "configs" / "data" / "stdlib.yaml")
    cfg.document_mask, cfg.num_proc, cfg.max_documents = False, 1, max_documents
    return build_data(cfg, SHAPE.seq_len, seed)


def build(job: dict, vocab: int):
    if job["impl"] == REFERENCE:
        return Logits(reference(REFERENCE, vocab, D, SHAPE))
    parametrization, edits = VARIANTS[job["variant"]]
    model = ours("gdn", vocab, D, parametrization, SHAPE)
    with torch.no_grad():
        for block in model.layers:
            for edit in edits:
                edit(block.mixer)
    return model


def run(job: dict) -> dict:
    from data.batches import global_batch
    from evaluation.scoring import score_validation
    from training.optim import param_groups

    torch.set_num_threads(1)
    data = corpus(job["seed"], job["max_documents"])
    torch.manual_seed(job["seed"])
    model = build(job, data.vocab_size)

    def batches(step):
        ids = data.train.batch(global_batch(step - 1, len(data.train), BATCH, job["seed"]))["input_ids"]
        return ids, ids

    trained = train(model, param_groups(model.named_parameters(), 0.1), batches, job["steps"], job["lr"], WARMUP,
                    lambda m: score_validation(m, data, BATCH, EVAL_SEQUENCES, torch.device("cpu")), job["eval_every"])
    curve = [[step, val["val/bpb"]] for step, val in trained["evals"]]
    return {**job, "bpb": curve[-1][1], "curve": curve, "cpu_s": trained["cpu_s"], "params": trained["params"]}


def job_key(job: dict) -> tuple:
    return tuple(job[k] for k in ("impl", "variant", "lr", "seed", "steps", "max_documents"))


def side(job: dict) -> str:
    return job["impl"] if job["impl"] == REFERENCE else f"ours, {job['variant']}"


def summarize(runs: list[dict]) -> dict[str, dict]:
    sides = {}
    for r in runs:
        sides.setdefault(side(r), []).append(r)
    return {name: best_over_lr(rs, "bpb", higher_is_better=False) for name, rs in sides.items()}


def write_table(best: dict[str, dict], steps: int, path: Path, rerun: str) -> None:
    ref = best.get(REFERENCE)
    lines = [f"Val bits per byte after {steps} steps, each side at its best lr; mean (min-max) over seeds.", "",
             "| model | val bpb | best lr | lrs tried | seeds | minus the reference |", "|---|---|---|---|---|---|"]
    for name, b in sorted(best.items(), key=lambda kv: kv[1]["mean"]):
        gap = f"{b['mean'] - ref['mean']:+.4f}" if ref else "-"
        lrs = ", ".join(f"{lr:g}" for lr in b["lrs"])
        flag = f" [{b['edge']}]" if b["edge"] else ""
        lines.append(f"| {name} | {b['mean']:.4f} ({b['lo']:.4f}-{b['hi']:.4f}) | {b['lr']:g}{flag} | {lrs} | "
                     f"{b['seeds']} | {gap} |")
    edges = [f"{name}: {edge_text('lr', b['lr'], b['lrs'], b['edge'])}" for name, b in best.items() if b["edge"]]
    lines += [f"\n**Warning: {line}; extend it: {rerun} --lrs <lrs beyond>**" for line in edges]
    path.write_text("\n".join(lines) + "\n")


def plot_curves(best: dict[str, dict], path: Path) -> None:
    style = SeriesStyle()
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for name, b in sorted(best.items()):
        label = f"{name} (lr {b['lr']:g})"
        style.add(label, name)  # a colour per side
        at_step = zip(*[[tuple(point) for point in curve] for curve in b["curves"]])
        mean_band(ax, [list(points) for points in at_step], label, style(label))
    ax.set_xlabel("step")
    ax.set_ylabel("val bits per byte")
    ax.grid(alpha=0.3)
    legend_outside(ax)
    save_figure(fig, path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="default", help=f"ours, comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--lrs", default="1e-3,2e-3,4e-3,8e-3")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=120, help="the default run's")
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--no-reference", action="store_true", help="ours only")
    p.add_argument("--max-documents", type=int, default=None, help="the corpus's first N files (default: all)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, one thread each")
    p.add_argument("--out", default="reports/gdn_language")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        sys.exit(f"error: unknown --variants {bad[0]!r}; valid: {', '.join(VARIANTS)}")
    lrs, seeds = [float(v) for v in args.lrs.split(",")], [int(v) for v in args.seeds.split(",")]
    base = {"steps": args.steps, "eval_every": args.eval_every, "max_documents": args.max_documents}
    sides = [("ours", v) for v in variants] + ([] if args.no_reference else [(REFERENCE, "own")])
    jobs = [{"impl": impl, "variant": v, "lr": lr, "seed": s, **base} for s in seeds for lr in lrs for impl, v in sides]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    run_pending(jobs, run, job_key, log, args.jobs,
                lambda r: f"{side(r)} lr {r['lr']:g} seed {r['seed']}: val bpb {r['bpb']:.4f}")
    runs = [r for r in read_runs(log) if r["steps"] == args.steps and r["max_documents"] == args.max_documents]
    best = summarize(runs)
    rerun = f"python studies/gdn_language.py --seeds {args.seeds} --steps {args.steps} --out {shlex.quote(str(out))}"
    write_table(best, args.steps, out / "table.md", rerun)
    plot_curves(best, out / "curves.png")
    print((out / "table.md").read_text() + f"wrote table.md and curves.png in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
