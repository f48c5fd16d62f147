"""eval.py's suites in the report: per suite one comparison, `compare_<suite>(points, out, style) -> (figures,
compare.md lines, notes)`, over EvalPoints (each architecture at its best value, its seeds' eval.json averaged, or
each run). A point without a suite's block is left out of that suite's figures."""
import statistics
from dataclasses import dataclass
from pathlib import Path

from analysis.best import Architecture
from analysis.runs import Run
from common.plots import SeriesStyle, legend_outside, pyplot, save_figure
from training.suites import log_binned

LENGTH_BINS = 16  # log-spaced bins of positions in length.png: fewer than eval.py's own plot, so that ten curves read


@dataclass
class EvalPoint:
    label: str
    mixer: str
    reports: list[dict]  # eval.json of each run it stands for (each seed of an architecture at its best value)
    over: str | None = None  # the key whose best value it stands at (None: a run)

    def blocks(self, suite: str) -> list[dict]:
        return [r[suite] for r in self.reports if isinstance(r.get(suite), dict)]


def eval_points(runs: list[Run], summaries: list[dict], archs: list[Architecture], key: str | None) -> list[EvalPoint]:
    """Under --best-over each architecture at its best value (its seeds' reports averaged), else each run."""
    if archs:
        return [EvalPoint(a.label, str(a.summary["mixer"]), [r.report for r in a.members[a.pick.value] if r.report], key)
                for a in archs]
    return [EvalPoint(s["run"], str(s["mixer"]), [run.report] if run.report else []) for run, s in zip(runs, summaries)]


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def decode_rows(report: dict) -> dict:
    """The decode suite's measured rows by context (skipped contexts left out)."""
    return {r["context"]: r for r in (report.get("decode") or {}).get("rows", []) if "skipped" not in r and "context" in r}


def recall_grid(report: dict) -> tuple[list, list]:
    """The recall suite's contexts and its accuracy row at each: passkey (a row over depths) or, for an
    MQAR-trained run, MQAR (seq_len as the context, a row over num_kv_pairs, null where a cell cannot hold)."""
    recall = report.get("recall") or {}
    grid = recall.get("mqar", recall)
    contexts = grid.get("contexts", grid.get("seq_lens", []))
    rows = [[a for a in row if a is not None] for row in grid.get("acc", [])]
    return contexts, rows


def recall_acc_at(report: dict, context) -> float | None:
    """Recall accuracy at one context of the recall suite, the mean over its row (depths, or MQAR's kv pairs)."""
    contexts, rows = recall_grid(report)
    return mean(rows[contexts.index(context)]) if context in contexts and len(rows) == len(contexts) else None


def common_context(reports: list[dict], contexts_of) -> int | None:
    """The largest context every report has (contexts_of(report): its contexts)."""
    sets = [set(contexts_of(r)) for r in reports]
    common = set.intersection(*sets) if sets else set()
    return max(common) if common else None


def length_table(points: list[EvalPoint]) -> str | None:
    """The length suite's loss per band (1x, 2x, ... the training length), mean over a point's reports."""
    rows = [(p, p.blocks("length")) for p in points if p.blocks("length")]
    bands = sorted({b for _, blocks in rows for block in blocks for b in block.get("bands", {})},
                   key=lambda b: float(b.rstrip("x")))
    if not bands:
        return None
    lines = [f"| {'architecture' if rows[0][0].over else 'run'} | " + " | ".join(bands) + " |", "|---" * (len(bands) + 1) + "|"]
    for p, blocks in rows:
        cells = [mean(block.get("bands", {}).get(b) for block in blocks) for b in bands]
        lines.append(f"| {p.label} | " + " | ".join("-" if c is None else f"{c:.4g}" for c in cells) + " |")
    return "\n".join(lines)


def length_curve(blocks: list[dict]) -> tuple[int, list[float]] | None:
    """(the longest length evaluated, mean loss per position there over the blocks that have it)."""
    lengths = [int(k) for b in blocks for k in b.get("per_position", {})]
    if not lengths:
        return None
    curves = [b["per_position"][str(max(lengths))] for b in blocks if str(max(lengths)) in b.get("per_position", {})]
    return max(lengths), [statistics.mean(losses) for losses in zip(*curves)]


def compare_length(points: list[EvalPoint], out: Path, style: SeriesStyle) -> tuple[list[Path], list[str], list[str]]:
    """length.png (loss by position at the longest length evaluated, in LENGTH_BINS log-spaced bins, the training
    length marked and the positions past it shaded) and compare.md's table "Loss by length"."""
    md, written = [], []
    table = length_table(points)
    if table:
        over = next(p.over for p in points)
        md = ["## Loss by length (eval.py's length suite)", "", table, "",
              "loss (nats/token) in each length band of eval.py's length suite, in multiples of the training length"
              + (f"; mean over seeds at the best {over}" if over else "") + ".", ""]
    curves = [(p, curve) for p in points if (curve := length_curve(p.blocks("length")))]
    if curves:
        fig, ax = pyplot().subplots(figsize=(7, 4.5))
        lengths = {length for _, (length, _) in curves}
        for p, (length, losses) in curves:
            look = style(p.label)
            ax.plot(*log_binned(losses, LENGTH_BINS), lw=1.2, color=look["color"], linestyle=look["linestyle"],
                    label=p.label if len(lengths) == 1 else f"{p.label} (length {length})")
        trained = sorted({b["train_seq_len"] for p, _ in curves for b in p.blocks("length") if b.get("train_seq_len")})
        for t in trained:
            ax.axvline(t, color="gray", ls="--", lw=1, label=f"training length {t}")
        if trained:
            ax.axvspan(trained[0], max(length for _, (length, _) in curves), color="gray", alpha=0.08, lw=0)
        ax.set_xscale("log")
        ax.set(xlabel="position" + (f" (in sequences of {lengths.pop()} tokens)" if len(lengths) == 1 else ""),
               ylabel="loss (nats/token)")
        ax.grid(alpha=0.3)
        legend_outside(ax)
        written.append(save_figure(fig, out / "length.png"))
    return written, md, []


def compare_recall(points: list[EvalPoint], out: Path, style: SeriesStyle) -> tuple[list[Path], list[str], list[str]]:
    """recall_state.png (recall accuracy against decode-cache bytes at the largest context every point's recall and
    decode suites share, as zoology) and recall_throughput.png (recall/acc or recall/mqar_acc against decode tokens/s
    at the largest context every point decoded, as Based); a note for a plot with no context in common."""
    written, notes = [], []
    both = [p for p in points if p.blocks("recall") and p.blocks("decode")]
    reports = [r for p in both for r in p.reports if r.get("recall") and r.get("decode")]
    state_at = common_context(reports, lambda r: set(recall_grid(r)[0]) & set(decode_rows(r)))
    speed_at = common_context(reports, lambda r: decode_rows(r))
    for name, context, x_of, y_of, xlabel, ylabel in (
            ("recall_state.png", state_at, lambda r, c: decode_rows(r)[c].get("cache_bytes"), recall_acc_at,
             "decode-cache bytes per sequence", "recall accuracy (mean over depths)"),
            ("recall_throughput.png", speed_at, lambda r, c: decode_rows(r)[c].get("decode_tokens_per_sec"),
             lambda r, c: next((v for k in ("recall/acc", "recall/mqar_acc") if (v := (r.get("scores") or {}).get(k)) is not None), None),
             "decode tokens/s", "recall accuracy (recall/acc or recall/mqar_acc)")):
        if context is None:
            if both:
                notes.append(f"{name}: no context that every run's recall and decode suites share")
            continue
        fig, ax = pyplot().subplots(figsize=(6.5, 4.5))
        for p in both:
            measured = [r for r in p.reports if r.get("recall") and r.get("decode")]
            x, y = mean(x_of(r, context) for r in measured), mean(y_of(r, context) for r in measured)
            if x is not None and y is not None:
                ax.plot(x, y, ms=7, label=p.label, **{**style(p.label), "linestyle": "none"})
        ax.set_xscale("log")
        ax.set_xlabel(f"{xlabel} at context {context}")
        ax.set_ylabel(f"{ylabel} at context {context}" if name == "recall_state.png" else ylabel)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        legend_outside(ax)
        written.append(save_figure(fig, out / name))
    return written, [], notes


def compare_decode(points: list[EvalPoint], out: Path, style: SeriesStyle) -> tuple[list[Path], list[str], list[str]]:
    """decode.png: decode tokens/s and decode-cache bytes against the context, one line per point."""
    decoded = [p for p in points if p.blocks("decode")]
    if not decoded:
        return [], [], []
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"wspace": 0.3})
    for p in decoded:
        by_context = [decode_rows(r) for r in p.reports if r.get("decode")]
        contexts = sorted({c for rows in by_context for c in rows})
        for ax, field_name in zip(axes, ("decode_tokens_per_sec", "cache_bytes")):
            values = [mean(rows[c].get(field_name) for rows in by_context if c in rows) for c in contexts]
            pts = [(c, v) for c, v in zip(contexts, values) if v is not None]
            if pts:
                ax.plot(*zip(*pts), ms=4, label=p.label, **style(p.label))
    for ax, ylabel in zip(axes, ("decode tokens/s", "decode-cache bytes per sequence")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="context (tokens)", ylabel=ylabel)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    legend_outside(axes[1])
    return [save_figure(fig, out / "decode.png")], [], []

