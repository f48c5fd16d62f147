"""The length suite: the val loss by position at the training length T and at multiples of it, and its
mean per band of positions (band "kx": ((k/2) T, k T], the last half of k T; so "1x" is (T/2, T]), so that
"kx minus 1x" says how the model extrapolates past the length it trained at: every band's positions have at
least half their length of context, and the early positions' lack of it is in none."""
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common.plots import legend_outside, pyplot, save_figure
from data.types import Split
from evaluation.context import first_line, positions_up_to, too_long
from evaluation.per_position import log_binned, plot_loss_by_position
from evaluation.suites import SUITES, EvalPoint, Suite, points_table
from model.options import option

FACTORS = (1, 2, 4, 8, 16, 32)
REPORT_BINS = 16  # log-spaced bins of positions in compare.py's length.png: fewer than one model's plot, so that ten curves read


@dataclass
class LengthOptions:
    factors: list[int] = option([1, 2, 4, 8], choices=FACTORS)  # lengths: these multiples of the training seq_len
    sequences: int = option(8, at_least=1)  # val sequences per length (each inside one document with document masking)


def single_document_blocks(split: Split, n: int, chunk: int = 256) -> torch.Tensor:
    """The first n blocks [n, L] of the split that lie in one document: with document masking a block
    counts if its position_ids run 0..L-1 unbroken, so that position t really has t tokens of context;
    without it (the model trained across documents), every block counts."""
    found, total = [], 0
    for idx in torch.arange(len(split)).split(chunk):
        batch = split.batch(idx)
        ids = batch["input_ids"]
        if "position_ids" in batch:
            ids = ids[batch["position_ids"][:, -1] == ids.shape[1] - 1]
        found.append(ids)
        total += len(ids)
        if total >= n:
            break
    return torch.cat(found)[:n]


@torch.no_grad()
def position_losses(lm, ids: torch.Tensor, batch_tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over the sequences ids [N, L] of the loss at each target position p = 1..L-1 (token p
    predicted from tokens 0..p-1), and how many sequences scored each: two [L-1] tensors. Forwards of
    max(1, batch_tokens // L) sequences."""
    length = ids.shape[1]
    loss_sum = torch.zeros(length - 1, dtype=torch.float64)
    count = torch.zeros(length - 1, dtype=torch.long)
    for chunk in ids.split(max(1, batch_tokens // length)):
        chunk = chunk.to(device)
        logits = lm(input_ids=chunk).logits[:, :-1].float()
        loss = F.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none")  # [B, L-1]
        loss_sum += loss.double().sum(0).cpu()
        count += torch.isfinite(loss).sum(0).cpu()
    return loss_sum, count


def bands(per_position: list[float], train_seq_len: int, factors: list[int]) -> dict[str, float]:
    """Mean loss per band of target positions p (1-based, per_position[p - 1]): band "kx" is p in ((k/2) T, k T]
    ("1x": (T/2, T]); each cut at the positions there are (L - 1 of them)."""
    out = {}
    for k in sorted(factors):
        band = per_position[k * train_seq_len // 2:k * train_seq_len]
        if band:
            out[f"{k}x"] = float(np.mean(band))
    return out


def loss_by_length(lm, val_at, train_seq_len: int, factors: list[int], sequences: int, batch_tokens: int,
                   device) -> dict:
    """The loss by position over `sequences` val blocks of each length L = k T (single_document_blocks;
    val_at(L) gives the val Split at block length L), and the mean per band from the longest length
    evaluated (one set of sequences for every band, bands()). A length is skipped, with the reason, past
    max_position_embeddings of a model with positions (too_long), out of memory, or when the val split has
    no such block. Forwards of batch_tokens tokens."""
    T = train_seq_len
    report = {"train_seq_len": T, "seq_lens": [], "per_position": {}, "positions_scored": {}, "sequences": {},
              "skipped": {}}
    for k in sorted(factors):
        length = k * T
        reason = too_long(lm, length)
        if reason is None:
            try:
                ids = single_document_blocks(val_at(length), sequences)
                if len(ids) == 0:
                    reason = f"no val block of {length} tokens lies in one document"
                else:
                    start = time.perf_counter()
                    with positions_up_to(lm, length):
                        loss_sum, count = position_losses(lm, ids, batch_tokens, device)
            except ValueError as e:  # no text, or a val split that cannot fill one block
                reason = first_line(e)
            except torch.OutOfMemoryError as e:
                reason = f"out of memory: {first_line(e)}"
        if reason is not None:
            report["skipped"][f"{k}x"] = reason
            print(f"length {length} ({k}x): skipped, {reason}")
            continue
        per_position = (loss_sum / count.clamp(min=1)).tolist()
        report["seq_lens"].append(length)
        report["per_position"][str(length)] = per_position
        report["positions_scored"][str(length)] = int((count == len(ids)).sum())
        report["sequences"][str(length)] = len(ids)
        print(f"length {length} ({k}x): {len(ids)} sequences, loss {np.mean(per_position):.4f} "
              f"[{time.perf_counter() - start:.1f}s]")
    longest = report["seq_lens"][-1] if report["seq_lens"] else None
    evaluated = [k for k in factors if k * T <= (longest or 0)]
    report["bands"] = bands(report["per_position"][str(longest)], T, evaluated) if longest else {}
    return report


def length_table(points: list[EvalPoint]) -> str | None:
    """The length suite's loss per band (1x, 2x, ... the training length), mean over a point's reports."""
    bands = sorted({b for p in points for block in p.blocks("length") for b in block.get("bands", {})},
                   key=lambda b: float(b.rstrip("x")))
    return points_table(points, bands, lambda r, b: (r.get("length") or {}).get("bands", {}).get(b)) if bands else None


def length_curve(blocks: list[dict]) -> tuple[int, list[float]] | None:
    """(the longest length evaluated, mean loss per position there over the blocks that have it)."""
    lengths = [int(k) for b in blocks for k in b.get("per_position", {})]
    if not lengths:
        return None
    curves = [b["per_position"][str(max(lengths))] for b in blocks if str(max(lengths)) in b.get("per_position", {})]
    return max(lengths), [statistics.mean(losses) for losses in zip(*curves)]


@SUITES.register("length")
class Length(Suite):
    Options = LengthOptions
    quick_options = {"factors": [1, 2], "sequences": 2}

    def run(self, ctx, opts: LengthOptions) -> dict:
        return loss_by_length(ctx.lm, ctx.val_at, ctx.train_seq_len, opts.factors, opts.sequences,
                              ctx.batch_size * ctx.train_seq_len, ctx.device)

    def scores(self, block: dict) -> dict[str, float]:
        return {f"length/loss_{band}": loss for band, loss in block["bands"].items()}

    def plot(self, block: dict, title: str, folder: Path) -> list[Path]:
        if not block["seq_lens"]:
            return []
        curves = {f"L = {length}": block["per_position"][str(length)] for length in block["seq_lens"]}
        return [plot_loss_by_position(curves, block["train_seq_len"], title, Path(folder) / "length_loss.png")]

    def compare(self, points: list[EvalPoint], out: Path, style) -> tuple[list[Path], list[str], list[str]]:
        """length.png (loss by position at the longest length evaluated, in REPORT_BINS log-spaced bins, the training
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
                ax.plot(*log_binned(losses, REPORT_BINS), lw=1.2, color=look["color"], linestyle=look["linestyle"],
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
