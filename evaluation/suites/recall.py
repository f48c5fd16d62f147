"""The recall suite: a passkey hidden at a chosen depth of a context of val text and asked for at the end,
scored over contexts x depths by greedy exact match, the answer's log-probability, a forced choice of the
key among candidates and the key's log-probability lift over the same context without the needle; and per
context a copy score (the loss on the second occurrence of a repeated span minus the first). The graded
scores move before exact match does (small models). A model trained on MQAR (data=mqar) instead gets MQAR
accuracy over seq_len x the number of key-value pairs."""
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common.plots import legend_outside, pyplot, save_figure
from data.types import Split
from evaluation.context import first_line, positions_up_to, too_long
from evaluation.suites import SUITES, EvalPoint, Suite, mean, points_table
from evaluation.suites.decode import decode_rows
from model.options import bad_option, option

NEEDLE_KEY = 'passkey = "'  # the needle is NEEDLE_KEY + key + '"', the query NEEDLE_KEY
KEY_DIGITS = 5


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


def encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)


def passkey_example(filler: torch.Tensor, tokenizer, context: int, depth: float,
                    key: str) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """(input_ids, answer_ids, needle) of one passkey trial of `context` tokens in all (prompt + answer):
    F = context - |needle| - |query| - |answer| filler tokens (filler[:F]) with the needle
    "\\npasskey = \\"<key>\\"\\n" inserted at token p = round(depth F), then the query "\\npasskey = \\"".
    needle is the needle's slice of input_ids, p to p + |needle|; the answer (the key's tokens, as in the
    needle) starts at p + |"\\n"| + |'passkey = "'|. Each piece is tokenized on its own, so the answer's tokens
    in the needle are exactly answer_ids."""
    newline, lead = encode(tokenizer, "\n"), encode(tokenizer, NEEDLE_KEY)
    answer = encode(tokenizer, key)
    needle = torch.cat([newline, lead, answer, encode(tokenizer, '"\n')])
    query = torch.cat([newline, lead])
    size = context - len(needle) - len(query) - len(answer)
    if size < 0 or len(filler) < size:
        raise ValueError(f"passkey context {context} with {len(filler)} filler tokens: needs "
                         f"{len(needle) + len(query) + len(answer)} + filler tokens")
    p = round(depth * size)
    return torch.cat([filler[:p], needle, filler[p:size], query]), answer, slice(p, p + len(needle))


def without_needle(input_ids: torch.Tensor, needle: slice) -> torch.Tensor:
    """The same haystack and query with the needle's tokens taken out (the filler joined where it sat)."""
    return torch.cat([input_ids[:needle.start], input_ids[needle.stop:]])


def passkey_trials(stream: torch.Tensor, context: int, trials: int, candidates: int,
                   seed: int) -> list[tuple[str, torch.Tensor, list[str]]]:
    """(key, window, distractors) of each trial i at a context, drawn from (seed, context, i): the key (KEY_DIGITS
    random digits), its window of `context` tokens of the val stream, then candidates - 1 distractors (draw_keys)."""
    out = []
    for i in range(trials):
        rng = np.random.default_rng([seed, context, i])
        key = "".join(map(str, rng.integers(0, 10, KEY_DIGITS)))
        offset = int(rng.integers(0, len(stream) - context + 1))
        out.append((key, stream[offset:offset + context], draw_keys(rng, candidates - 1, key)))
    return out


def draw_keys(rng: np.random.Generator, count: int, exclude: str) -> list[str]:
    """`count` distinct keys of KEY_DIGITS random digits, none equal to `exclude`: the forced choice's
    distractors, drawn as the true key is, so that to a model blind to the needle every candidate is alike."""
    keys: list[str] = []
    while len(keys) < count:
        key = "".join(map(str, rng.integers(0, 10, KEY_DIGITS)))
        if key != exclude and key not in keys:
            keys.append(key)
    return keys


@torch.no_grad()
def score_continuations(lm, input_ids: torch.Tensor, continuations: list[torch.Tensor],
                        device) -> tuple[list[torch.Tensor], list[bool]]:
    """For each continuation of the prompt input_ids: the log-prob of each of its tokens given the prompt
    and its tokens before it, and whether every token is the argmax there (what greedy decoding produces).
    One forward of the prompt that builds the decode cache, the cache repeated into a row per continuation,
    and one forward of the continuations side by side (right-padded: a causal model's scores of a token do
    not see the padding after it)."""
    first = lm(input_ids=input_ids[None].to(device), use_cache=True, logits_to_keep=1)
    cache, n, width = first.past_key_values, len(continuations), max(len(c) for c in continuations)
    logits = first.logits.float().expand(n, 1, -1)
    if width > 1:
        rows = torch.zeros(n, width - 1, dtype=torch.long)
        for i, c in enumerate(continuations):
            rows[i, :len(c) - 1] = c[:-1]
        cache.reorder_cache(torch.zeros(n, dtype=torch.long, device=device))
        logits = torch.cat([logits, lm(input_ids=rows.to(device), past_key_values=cache).logits.float()], 1)
    logprobs = logits.log_softmax(-1)
    out, greedy = [], []
    for i, c in enumerate(continuations):
        c = c.to(device)
        out.append(logprobs[i, :len(c)].gather(-1, c[:, None])[:, 0].cpu())
        greedy.append(bool((logits[i, :len(c)].argmax(-1) == c).all()))
    return out, greedy


def first_place_share(scores: list[float]) -> float:
    """The forced choice's credit for one trial, scores[0] being the true key's: 1 / m when it ties m
    candidates (itself included) at the highest score, 0 when one scores higher (a random pick among the
    tied, in expectation; so a model that scores every candidate alike gets 1 / len(scores) exactly)."""
    top = max(scores)
    return 1.0 / scores.count(top) if scores[0] == top else 0.0


def copy_example(window: torch.Tensor, span: int) -> tuple[torch.Tensor, slice, slice]:
    """(input_ids, first, second) of one copy trial of C = len(window) tokens: the span s = window[:span] and
    the filler f = window[span:C - span], laid out f[:C/2 - span] s f[C/2 - span:] s, so that s occurs at
    C/2 - span and at C - span (C/2 tokens apart), each time after at least C/2 - span filler tokens and
    neither time after the text that preceded it in the val stream. first and second are the slices of the
    target positions scored (a target position t is token t predicted from tokens 0..t-1): each occurrence's
    tokens but its first, which nothing announces."""
    C = len(window)
    s, fill, lead = window[:span], window[span:C - span], C // 2 - span
    ids = torch.cat([fill[:lead], s, fill[lead:], s])
    return ids, slice(lead + 1, lead + span), slice(C - span + 1, C)


@torch.no_grad()
def copy_losses(lm, windows: torch.Tensor, span: int, device) -> tuple[float, float]:
    """The mean loss (nats/token) on the first and on the second occurrence of the span in the copy trials
    (copy_example) of the val windows [N, C], in one forward."""
    examples = [copy_example(w, span) for w in windows]
    ids = torch.stack([ids for ids, _, _ in examples]).to(device)
    loss = F.cross_entropy(lm(input_ids=ids).logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    first, second = examples[0][1], examples[0][2]  # target position t is loss[:, t - 1]
    return (loss[:, first.start - 1:first.stop - 1].mean().item(), loss[:, second.start - 1:second.stop - 1].mean().item())


def filler_stream(split: Split, tokens: int, eos: int | None) -> torch.Tensor:
    """At least `tokens` tokens of val text (the split's first blocks, EOS dropped: a model trained with
    document masking never saw one mid-context), repeated if the split is shorter."""
    per_block = split.batch(torch.arange(1))["input_ids"].shape[1]
    blocks = min(len(split), math.ceil(tokens / per_block) + 1)
    stream = split.batch(torch.arange(blocks))["input_ids"].flatten()
    stream = stream[stream != eos] if eos is not None else stream
    return stream.repeat(math.ceil(tokens / len(stream))) if len(stream) < tokens else stream


def passkey_recall(lm, tokenizer, val: Split, contexts: list[int], depths: list[float], trials: int,
                   candidates: int, copy_span: int, seed: int, device) -> dict:
    """Passkey retrieval (passkey_example) over contexts x depths, each cell the mean over `trials`:
    acc = share of exact greedy answers, answer_logprob = mean log-prob per answer token, choice_acc = the
    forced choice among the key and candidates - 1 distractors by the log-prob of each whole key
    (first_place_share), lift = log p(key | prompt) - log p(key | the prompt without the needle) in nats
    per key; per context, copy = copy_second_loss - copy_first_loss (copy_losses on the trials' windows).
    The trials of a context (passkey_trials) are the same at every depth; trial i's copy trial is its window."""
    grids = ("acc", "answer_logprob", "choice_acc", "lift")
    report = {"contexts": [], "depths": list(depths), **{k: [] for k in grids}, "copy": [], "copy_first_loss": [],
              "copy_second_loss": [], "trials": trials, "candidates": candidates, "copy_span": copy_span, "skipped": {}}
    stream = filler_stream(val, max(contexts), tokenizer.eos_token_id)
    for context in contexts:
        if reason := too_long(lm, context):
            report["skipped"][str(context)] = reason
            print(f"recall {context}: skipped, {reason}")
            continue
        start = time.perf_counter()
        keys, windows, distractors = zip(*passkey_trials(stream, context, trials, candidates, seed))
        distractors = [[encode(tokenizer, k) for k in others] for others in distractors]
        cells = {k: [] for k in grids}
        with positions_up_to(lm, context):
            absent = []  # log p(key | no needle): one haystack at every depth
            for window, key in zip(windows, keys):
                ids, answer, needle = passkey_example(window, tokenizer, context, 0.0, key)
                absent.append(score_continuations(lm, without_needle(ids, needle), [answer], device)[0][0].sum().item())
            for depth in depths:
                trial = {k: [] for k in grids}
                for window, key, others, key_absent in zip(windows, keys, distractors, absent):
                    ids, answer, _ = passkey_example(window, tokenizer, context, depth, key)
                    logprobs, greedy = score_continuations(lm, ids, [answer, *others], device)
                    totals = [lp.sum().item() for lp in logprobs]
                    for k, v in zip(grids, (greedy[0], logprobs[0].mean().item(), first_place_share(totals),
                                            totals[0] - key_absent)):
                        trial[k].append(v)
                for k in grids:
                    cells[k].append(float(np.mean(trial[k])))
            first, second = copy_losses(lm, torch.stack(windows), copy_span, device)
        report["contexts"].append(context)
        for k in grids:
            report[k].append(cells[k])
        report["copy_first_loss"].append(first)
        report["copy_second_loss"].append(second)
        report["copy"].append(second - first)
        print(f"recall {context}: acc {np.mean(cells['acc']):.3f}, choice acc {np.mean(cells['choice_acc']):.3f} "
              f"(chance {1 / candidates:.2f}), lift {np.mean(cells['lift']):.2f} nats, copy {second - first:+.3f} nats/token, "
              f"answer log-prob {np.mean(cells['answer_logprob']):.3f} [{time.perf_counter() - start:.1f}s]")
    return report


def mqar_recall(lm, data_cfg, seq_lens: list[int], num_kv_pairs: list[int], examples: int, seed: int, device) -> dict:
    """MQAR accuracy on query labels (data/mqar.py's generator and query_accuracy) for each seq_len x
    num_kv_pairs: `examples` fresh examples per cell, seeded by (seed, 2, seq_len, n) (2: neither the
    train nor the test split's stream). A cell the protocol cannot hold (seq_len < 4 n, n >= V/2) or a
    seq_len the model cannot take (too_long) is null, with the reason in skipped."""
    from data.mqar import mqar_slice, query_accuracy

    acc, skipped = [], {}
    for seq_len in seq_lens:
        row, start, bound = [], time.perf_counter(), too_long(lm, seq_len)
        for n in num_kv_pairs:
            reason = bound
            if reason is None:
                rng = np.random.Generator(np.random.PCG64([seed, 2, seq_len, n]))
                try:
                    ids, labels = mqar_slice(examples, seq_len, n, data_cfg.vocab_size, data_cfg.power_a, rng)
                except ValueError as e:
                    reason = first_line(e)
            if reason is not None:
                skipped[f"T{seq_len}_kv{n}"] = reason
                row.append(None)
                continue
            with positions_up_to(lm, seq_len):
                split = Split(torch.from_numpy(ids), torch.from_numpy(labels))
                row.append(query_accuracy(lm, split, [("cell", slice(0, examples))], device)["val/mqar_acc/cell"])
        acc.append(row)
        print(f"recall mqar seq_len {seq_len}: acc {row} [{time.perf_counter() - start:.1f}s]")
    return {"mqar": {"seq_lens": list(seq_lens), "num_kv_pairs": list(num_kv_pairs), "acc": acc,
                     "examples": examples, "skipped": skipped}}


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
