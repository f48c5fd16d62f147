"""The recall suite: a passkey hidden at a chosen depth of a context of val text and asked for at the end,
scored over contexts x depths by greedy exact match, the answer's log-probability, a forced choice of the
key among candidates and the key's log-probability lift over the same context without the needle; and per
context a copy score (the loss on the second occurrence of a repeated span minus the first). The graded
scores move before exact match does (small models). A model trained on MQAR (data=mqar) instead gets MQAR
accuracy over seq_len x the number of key-value pairs. The probes are evaluation/recall_probes.py's; here
are the suite, its scores, its plots and its comparison across runs."""
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.plots import legend_outside, pyplot, save_figure
from evaluation.recall_probes import mqar_recall, passkey_recall
from evaluation.suites import SUITES, EvalPoint, Suite, mean, points_table
from evaluation.suites.decode import decode_rows
from model.options import bad_option, option


@dataclass
class RecallOptions:
    contexts: list[int] = option([256, 512, 1024, 2048], at_least=32)  # passkey contexts (tokens, prompt + answer)
    depths: list[float] = option([0.0, 0.25, 0.5, 0.75, 1.0], at_least=0, at_most=1)  # needle depth (0: first, 1: last)
    trials: int = option(5, at_least=1)  # passkeys per context and depth (trial i: one key and filler at every depth)
    candidates: int = option(10, at_least=2)  # forced choice: the key among this many keys (chance 1 / candidates)
    copy_span: int = option(16, at_least=2)  # copy score: tokens in the repeated span (at most min(contexts) / 4)
    mqar_factors: list[int] = option([1, 2, 4, 8], at_least=1)  # an MQAR-trained model: seq_len = these x the training's
    mqar_examples: int = option(64, at_least=1)  # an MQAR-trained model: examples per seq_len x num_kv_pairs cell

    def __post_init__(self):
        if 4 * self.copy_span > min(self.contexts):
            raise bad_option("recall suite", "copy_span", self.copy_span,
                             f"an integer >= 2 and <= min(recall.contexts) / 4 = {min(self.contexts) // 4}")


GRADED = ("acc", "choice_acc", "lift", "copy")  # the passkey grid's scores, each as recall/<name> and recall/<name>@<context>
GRADED_TITLES = {"acc": "exact match", "choice_acc": "forced choice (share of trials)", "lift": "lift (nats per key)",
                 "copy": "copy: second - first occurrence (nats/token)"}


def heatmap(fig, ax, values, rows: list, cols: list, title: str, ylabel: str, xlabel: str, **imshow) -> None:
    """values [rows, cols] (None: a cell not measured, "-") drawn with each cell's number on it."""
    import matplotlib.patheffects as effects

    values = np.array([[np.nan if a is None else a for a in row] for row in values], dtype=float).reshape(len(rows), len(cols))
    image = ax.imshow(values, aspect="auto", **imshow)
    for (i, j), a in np.ndenumerate(values):
        ax.text(j, i, "-" if np.isnan(a) else f"{a:.2f}", ha="center", va="center", fontsize=8,
                path_effects=[effects.withStroke(linewidth=2, foreground="w")])
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    fig.colorbar(image, ax=ax)


def plot_recall(report: dict, title: str, path: Path) -> Path:
    """MQAR: the accuracy heatmap over seq_len x num_kv_pairs. Passkey: heatmaps over contexts x depths of exact
    match, forced choice and lift, and the copy score against the context."""
    plt = pyplot()
    if "mqar" in report:
        grid = report["mqar"]
        rows, cols = grid["seq_lens"], grid["num_kv_pairs"]
        fig, ax = plt.subplots(figsize=(1.2 * len(cols) + 2, 0.6 * len(rows) + 2))
        heatmap(fig, ax, grid["acc"], rows, cols, f"{title}: MQAR accuracy", "seq_len", "num_kv_pairs",
                vmin=0, vmax=1, cmap="viridis")
        return save_figure(fig, path)
    rows, cols = report["contexts"], report["depths"]
    fig, axes = plt.subplots(1, 4, figsize=(4 * (1.2 * len(cols) + 2) + 3, 0.6 * len(rows) + 2.5))
    lift = max(1e-6, *(abs(v) for row in report["lift"] for v in row))
    for ax, values, name, look in (
            (axes[0], report["acc"], "exact match", dict(vmin=0, vmax=1, cmap="viridis")),
            (axes[1], report["choice_acc"], f"forced choice of {report['candidates']} (chance {1 / report['candidates']:.2f})",
             dict(vmin=0, vmax=1, cmap="viridis")),
            (axes[2], report["lift"], "lift: log p(key) with - without needle (nats)", dict(vmin=-lift, vmax=lift, cmap="RdBu"))):
        heatmap(fig, ax, values, rows, cols, name, "context (tokens)", "needle depth", **look)
    axes[3].plot(rows, report["copy"], "o-")
    axes[3].axhline(0, color="gray", lw=1)
    axes[3].set_xscale("log", base=2)
    axes[3].set(xlabel="context (tokens)", ylabel="second - first occurrence (nats/token)",
                title=f"copy ({report['copy_span']}-token span; < 0: copies)")
    axes[3].grid(alpha=0.3)
    fig.suptitle(f"{title}: recall")
    return save_figure(fig, path)


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


@SUITES.register("recall")
class Recall(Suite):
    Options = RecallOptions
    quick_options = {"contexts": [64, 128], "depths": [0.0, 1.0], "trials": 1, "candidates": 10, "copy_span": 16,
                     "mqar_factors": [1], "mqar_examples": 4}

    def run(self, ctx, opts: RecallOptions) -> dict:
        if ctx.data_cfg.name == "mqar":
            kv_pairs = sorted({s.num_kv_pairs for s in ctx.data_cfg.test})
            return mqar_recall(ctx.lm, ctx.data_cfg, [k * ctx.train_seq_len for k in opts.mqar_factors], kv_pairs,
                               opts.mqar_examples, ctx.seed, ctx.device)
        return passkey_recall(ctx.lm, ctx.data.tokenizer, ctx.data.val, opts.contexts, opts.depths, opts.trials,
                              opts.candidates, opts.copy_span, ctx.seed, ctx.device)

    def scores(self, block: dict) -> dict[str, float]:
        if "mqar" in block:
            grid = block["mqar"]
            cells = {f"recall/mqar_acc@T{s}_kv{n}": acc for s, row in zip(grid["seq_lens"], grid["acc"])
                     for n, acc in zip(grid["num_kv_pairs"], row) if acc is not None}
            return {**cells, "recall/mqar_acc": float(np.mean(list(cells.values())))} if cells else {}
        if not block["contexts"]:
            return {}
        out = {"recall/answer_logprob": float(np.mean(block["answer_logprob"]))}
        for name in GRADED:  # the mean over the grid, and over the depths at each context (copy: one per context)
            out[f"recall/{name}"] = float(np.mean(block[name]))
            out.update({f"recall/{name}@{c}": float(np.mean(row)) for c, row in zip(block["contexts"], block[name])})
        return out

    def plot(self, block: dict, title: str, folder: Path) -> list[Path]:
        if not block.get("contexts", True):  # a passkey grid with every context skipped has nothing to draw
            return []
        return [plot_recall(block, title, Path(folder) / "recall_heatmap.png")]

    def compare(self, points: list[EvalPoint], out: Path, style) -> tuple[list[Path], list[str], list[str]]:
        """recall_state.png and recall_throughput.png (recall_cost_plots), recall_graded.png and compare.md's table
        "Graded recall" (graded_recall)."""
        written, notes = recall_cost_plots(points, out, style)
        figures, md = graded_recall(points, out, style)
        return written + figures, md, notes


def recall_cost_plots(points: list[EvalPoint], out: Path, style) -> tuple[list[Path], list[str]]:
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
    return written, notes


def graded_recall(points: list[EvalPoint], out: Path, style) -> tuple[list[Path], list[str]]:
    """compare.md's table "Graded recall" (the scores recall/<name> of GRADED, each point's mean over its reports)
    and recall_graded.png (forced choice, lift and copy against the context, mean over depths, a line per point,
    the forced choice's chance dashed), from the passkey blocks that have them (an eval.json written before them
    has exact match only)."""
    graded = [(p, blocks) for p in points if (blocks := [b for b in p.blocks("recall") if "choice_acc" in b])]
    if not graded:
        return [], []
    over = points[0].over
    md = ["## Graded recall (eval.py's recall suite)", "",
          points_table(points, [f"recall/{name}" for name in GRADED], lambda r, key: (r.get("scores") or {}).get(key)), "",
          "mean over each run's contexts and depths: exact match and forced choice, the share of trials (chance 0 and "
          "1/candidates); lift, log p(key) with the needle minus without (nats per key, 0 for a model the needle does "
          "not inform); copy, the loss on a span's second occurrence minus its first (nats/token, < 0: the model "
          "copies)" + (f"; mean over seeds at the best {over}" if over else "") + ".", ""]
    fig, axes = pyplot().subplots(1, 3, figsize=(15, 4))
    for p, blocks in graded:
        for ax, name in zip(axes, GRADED[1:]):
            by_context: dict[int, list[float]] = {}
            for block in blocks:
                for context, row in zip(block["contexts"], block[name]):
                    by_context.setdefault(context, []).append(float(np.mean(row)))
            contexts = sorted(by_context)
            ax.plot(contexts, [mean(by_context[c]) for c in contexts], label=p.label, **style(p.label))
    for chance in sorted({1 / block["candidates"] for _, blocks in graded for block in blocks}):
        axes[0].axhline(chance, color="gray", ls="--", lw=1, label=f"chance ({chance:.2g})")
    for ax, name in zip(axes, GRADED[1:]):
        if name != "choice_acc":
            ax.axhline(0, color="gray", lw=1)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="context (tokens)", title=GRADED_TITLES[name])
        ax.grid(alpha=0.3)
    axes[0].set_ylim(-0.02, 1.02)
    legend_outside(axes[2])
    return [save_figure(fig, out / "recall_graded.png")], md
