"""The recall suite: a passkey hidden at a chosen depth of a context of val text and asked for at the end,
scored by greedy exact match and the answer's log-probability, over contexts x depths; a model trained on
MQAR (data=mqar) instead gets MQAR accuracy over seq_len x the number of key-value pairs."""
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.plots import legend_outside, pyplot, save_figure
from data.types import Split
from evaluation.context import first_line, positions_up_to, too_long
from evaluation.suites import SUITES, EvalPoint, Suite, mean
from evaluation.suites.decode import decode_rows
from model.options import option

NEEDLE_KEY = 'passkey = "'  # the needle is NEEDLE_KEY + key + '"', the query NEEDLE_KEY
KEY_DIGITS = 5


@dataclass
class RecallOptions:
    contexts: list[int] = option([256, 512, 1024, 2048], at_least=32)  # passkey contexts (tokens, prompt + answer)
    depths: list[float] = option([0.0, 0.25, 0.5, 0.75, 1.0], at_least=0, at_most=1)  # needle depth (0: first, 1: last)
    trials: int = option(5, at_least=1)  # passkeys per context and depth (trial i: one key and filler at every depth)
    mqar_factors: list[int] = option([1, 2, 4, 8], at_least=1)  # an MQAR-trained model: seq_len = these x the training's
    mqar_examples: int = option(64, at_least=1)  # an MQAR-trained model: examples per seq_len x num_kv_pairs cell


def encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)


def passkey_example(filler: torch.Tensor, tokenizer, context: int, depth: float,
                    key: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, answer_ids, needle_position) of one passkey trial of `context` tokens in all (prompt
    + answer): F = context - |needle| - |query| - |answer| filler tokens (filler[:F]) with the needle
    "\\npasskey = \\"<key>\\"\\n" inserted at token p = round(depth F), then the query "\\npasskey = \\"".
    needle_position is p, the needle's first token; the answer (the key's tokens, as in the needle)
    starts at p + |"\\n"| + |'passkey = "'|. Each piece is tokenized on its own, so the answer's tokens
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
    return torch.cat([filler[:p], needle, filler[p:size], query]), answer, p


def filler_stream(split: Split, tokens: int, eos: int | None) -> torch.Tensor:
    """At least `tokens` tokens of val text (the split's first blocks, EOS dropped: a model trained with
    document masking never saw one mid-context), repeated if the split is shorter."""
    per_block = split.batch(torch.arange(1))["input_ids"].shape[1]
    blocks = min(len(split), math.ceil(tokens / per_block) + 1)
    stream = split.batch(torch.arange(blocks))["input_ids"].flatten()
    stream = stream[stream != eos] if eos is not None else stream
    return stream.repeat(math.ceil(tokens / len(stream))) if len(stream) < tokens else stream


@torch.no_grad()
def score_answer(lm, input_ids: torch.Tensor, answer: torch.Tensor, device) -> tuple[bool, float]:
    """Greedy exact match of the answer after input_ids (every answer token the argmax given the prompt
    and the answer tokens before it: what greedy decoding produces), and the mean log-prob of the
    answer tokens, from one forward over prompt + answer[:-1]."""
    seq = torch.cat([input_ids, answer[:-1]])[None].to(device)
    logits = lm(input_ids=seq, logits_to_keep=len(answer)).logits[0].float()
    answer = answer.to(device)
    logprob = logits.log_softmax(-1).gather(-1, answer[:, None]).mean().item()
    return bool((logits.argmax(-1) == answer).all()), logprob


def passkey_recall(lm, tokenizer, val: Split, contexts: list[int], depths: list[float], trials: int, seed: int,
                   device) -> dict:
    """Passkey retrieval (passkey_example) over contexts x depths: acc = share of `trials` exact greedy
    answers, answer_logprob = mean log-prob per answer token. Trial i of a context draws its key
    (KEY_DIGITS random digits) and its filler offset from (seed, context, i), the same at every depth."""
    report = {"contexts": [], "depths": list(depths), "acc": [], "answer_logprob": [], "trials": trials, "skipped": {}}
    stream = filler_stream(val, max(contexts), tokenizer.eos_token_id)
    for context in contexts:
        if reason := too_long(lm, context):
            report["skipped"][str(context)] = reason
            print(f"recall {context}: skipped, {reason}")
            continue
        start = time.perf_counter()
        draws = [np.random.default_rng([seed, context, i]) for i in range(trials)]
        keys = ["".join(map(str, rng.integers(0, 10, KEY_DIGITS))) for rng in draws]
        offsets = [int(rng.integers(0, len(stream) - context + 1)) for rng in draws]
        acc, logprob = [], []
        with positions_up_to(lm, context):
            for depth in depths:
                results = [score_answer(lm, *passkey_example(stream[o:o + context], tokenizer, context, depth, key)[:2],
                                        device) for key, o in zip(keys, offsets)]
                acc.append(float(np.mean([hit for hit, _ in results])))
                logprob.append(float(np.mean([lp for _, lp in results])))
        report["contexts"].append(context)
        report["acc"].append(acc)
        report["answer_logprob"].append(logprob)
        print(f"recall {context}: acc {np.mean(acc):.3f}, answer log-prob {np.mean(logprob):.3f} "
              f"[{time.perf_counter() - start:.1f}s]")
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


def plot_recall(report: dict, title: str, path: Path) -> Path:
    """Accuracy heatmap: contexts x depths (passkey) or seq_len x num_kv_pairs (MQAR)."""
    plt = pyplot()
    if "mqar" in report:
        grid = report["mqar"]
        rows, cols, acc = grid["seq_lens"], grid["num_kv_pairs"], grid["acc"]
        ylabel, xlabel = "seq_len", "num_kv_pairs"
    else:
        rows, cols, acc = report["contexts"], report["depths"], report["acc"]
        ylabel, xlabel = "context (tokens)", "needle depth"
    values = np.array([[np.nan if a is None else a for a in row] for row in acc], dtype=float)
    values = values.reshape(len(rows), len(cols))
    fig, ax = plt.subplots(figsize=(1.2 * len(cols) + 2, 0.6 * len(rows) + 2))
    image = ax.imshow(values, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    for (i, j), a in np.ndenumerate(values):
        ax.text(j, i, "-" if np.isnan(a) else f"{a:.2f}", ha="center", va="center", color="w" if a < 0.5 else "k")
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}: recall accuracy")
    fig.colorbar(image, ax=ax)
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
    quick_options = {"contexts": [64, 128], "depths": [0.0, 1.0], "trials": 1, "mqar_factors": [1], "mqar_examples": 4}

    def run(self, ctx, opts: RecallOptions) -> dict:
        if ctx.data_cfg.name == "mqar":
            kv_pairs = sorted({s.num_kv_pairs for s in ctx.data_cfg.test})
            return mqar_recall(ctx.lm, ctx.data_cfg, [k * ctx.train_seq_len for k in opts.mqar_factors], kv_pairs,
                               opts.mqar_examples, ctx.seed, ctx.device)
        return passkey_recall(ctx.lm, ctx.data.tokenizer, ctx.data.val, opts.contexts, opts.depths, opts.trials,
                              ctx.seed, ctx.device)

    def scores(self, block: dict) -> dict[str, float]:
        if "mqar" in block:
            grid = block["mqar"]
            cells = {f"recall/mqar_acc@T{s}_kv{n}": acc for s, row in zip(grid["seq_lens"], grid["acc"])
                     for n, acc in zip(grid["num_kv_pairs"], row) if acc is not None}
            return {**cells, "recall/mqar_acc": float(np.mean(list(cells.values())))} if cells else {}
        if not block["contexts"]:
            return {}
        return {"recall/acc": float(np.mean(block["acc"])),
                **{f"recall/acc@{c}": float(np.mean(row)) for c, row in zip(block["contexts"], block["acc"])},
                "recall/answer_logprob": float(np.mean(block["answer_logprob"]))}

    def plot(self, block: dict, title: str, folder: Path) -> list[Path]:
        if not block.get("contexts", True):  # a passkey grid with every context skipped has nothing to draw
            return []
        return [plot_recall(block, title, Path(folder) / "recall_heatmap.png")]

    def compare(self, points: list[EvalPoint], out: Path, style) -> tuple[list[Path], list[str], list[str]]:
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
