"""eval.py's suites (`suite=[length,recall,decode]`), each a function of the model that returns its part
of eval.json, then its flat scores and a PNG:

- length: the val loss by position at the training length T and at multiples of it, and its mean per
  band of positions (length_suite);
- recall: a passkey hidden at a chosen depth of a context of val text, asked for at the end
  (passkey_example, recall_suite); an MQAR-trained model instead gets MQAR accuracy against seq_len
  and the number of key-value pairs (mqar_suite);
- decode: prefill and decode tokens/s, peak memory and decode-cache bytes against the context
  (decode_suite).

Sequences longer than max_position_embeddings: DecoderLM refuses them. A model with rotary positions
(softmax, dsa, derived_gdn and linear apply SoftmaxAttention's rotary) is not measured past it: that
length is skipped with the reason. A model without positions (every layer gdn or mamba2) has nothing
that bound protects, and is measured at any length (positions_up_to lifts it for the measurement). The
decode suite measures cost on random tokens, which positions past the bound do not change (rotary is
computed per call, from the position): it lifts the bound for every model."""
import ctypes
import math
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from data.types import Split
from common.plots import pyplot

NEEDLE_KEY = 'passkey = "'  # the needle is NEEDLE_KEY + key + '"', the query NEEDLE_KEY
KEY_DIGITS = 5


# ---- lengths past the position bound -------------------------------------------------------------
def too_long(lm, length: int) -> str | None:
    """Why `length` tokens cannot be measured on this model, or None: past max_position_embeddings with
    a layer that applies rotary positions (the mixers built on SoftmaxAttention carry `rotary`)."""
    limit = lm.config.max_position_embeddings
    rotary = sorted({name for name, block in zip(lm.config.layer_mixers, lm.layers) if hasattr(block.mixer, "rotary")})
    if length > limit and rotary:
        return f"{length} tokens exceed max_position_embeddings={limit} (rotary positions in {', '.join(rotary)})"
    return None


@contextmanager
def positions_up_to(lm, length: int):
    """DecoderLM refuses sequences past max_position_embeddings; lift that bound to `length` for the
    measurement (too_long has already refused the models with positions)."""
    limit = lm.config.max_position_embeddings
    lm.config.max_position_embeddings = max(limit, length)
    try:
        yield
    finally:
        lm.config.max_position_embeddings = limit


def first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


# ---- length --------------------------------------------------------------------------------------
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
    """Mean loss per band of target positions p (1-based, per_position[p - 1]): band "1x" is p in [1, T],
    band "kx" (k >= 2) is p in ((k/2) T, k T]; each cut at the positions there are (L - 1 of them)."""
    out = {}
    for k in sorted(factors):
        lo, hi = (1, train_seq_len) if k == 1 else (k * train_seq_len // 2 + 1, k * train_seq_len)
        band = per_position[lo - 1:hi]
        if band:
            out[f"{k}x"] = float(np.mean(band))
    return out


def length_suite(lm, val_at, train_seq_len: int, factors: list[int], sequences: int, batch_tokens: int,
                 device) -> dict:
    """The loss by position over `sequences` val blocks of each length L = k T (single_document_blocks;
    val_at(L) gives the val Split at block length L), and the mean per band from the longest length
    evaluated (one set of sequences for every band, bands()). A length is skipped, with the reason,
    past max_position_embeddings of a model with positions (too_long), out of memory, or when the val
    split has no such block."""
    report = {"train_seq_len": train_seq_len, "seq_lens": [], "per_position": {}, "positions_scored": {},
              "sequences": {}, "skipped": {}}
    for k in sorted(factors):
        length = k * train_seq_len
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
    evaluated = [k for k in factors if k * train_seq_len <= (longest or 0)]
    report["bands"] = bands(report["per_position"][str(longest)], train_seq_len, evaluated) if longest else {}
    return report


def length_scores(report: dict) -> dict[str, float]:
    return {f"length/loss_{band}": loss for band, loss in report["bands"].items()}


def log_binned(losses: list[float], bins: int = 48) -> tuple[list[float], list[float]]:
    """The loss at target positions 1..n averaged within `bins` log-spaced bins of positions (over a few
    sequences one position's loss is mostly noise): (each bin's mean position, its mean loss)."""
    positions = np.arange(1, len(losses) + 1)
    edges = np.unique(np.rint(np.geomspace(1, len(losses) + 1, bins + 1)).astype(int))
    cuts = [(positions >= lo) & (positions < hi) for lo, hi in zip(edges[:-1], edges[1:])]
    return ([float(positions[c].mean()) for c in cuts if c.any()],
            [float(np.asarray(losses)[c].mean()) for c in cuts if c.any()])


def plot_length(report: dict, title: str, path: Path) -> Path:
    """Loss by position (log x, averaged in log-spaced bins: log_binned) at each length, a vertical line at the
    training length."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for length in report["seq_lens"]:
        ax.plot(*log_binned(report["per_position"][str(length)]), label=f"L = {length}", linewidth=0.8)
    ax.axvline(report["train_seq_len"], color="gray", linestyle="--", label="training length")
    ax.set_xscale("log")
    ax.set_xlabel("target position (tokens of context)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{title}: loss by position")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- recall --------------------------------------------------------------------------------------
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


def recall_suite(lm, tokenizer, val: Split, contexts: list[int], depths: list[float], trials: int, seed: int,
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


def recall_scores(report: dict) -> dict[str, float]:
    if "mqar" in report:
        grid = report["mqar"]
        cells = {f"recall/mqar_acc@T{s}_kv{n}": acc for s, row in zip(grid["seq_lens"], grid["acc"])
                 for n, acc in zip(grid["num_kv_pairs"], row) if acc is not None}
        return {**cells, "recall/mqar_acc": float(np.mean(list(cells.values())))} if cells else {}
    if not report["contexts"]:
        return {}
    return {"recall/acc": float(np.mean(report["acc"])),
            **{f"recall/acc@{c}": float(np.mean(row)) for c, row in zip(report["contexts"], report["acc"])},
            "recall/answer_logprob": float(np.mean(report["answer_logprob"]))}


def mqar_suite(lm, data_cfg, seq_lens: list[int], num_kv_pairs: list[int], examples: int, seed: int, device) -> dict:
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- decode --------------------------------------------------------------------------------------
class PeakMemory:
    """Peak memory above the start of the block, in bytes (`.peak`): on CUDA torch's max allocated
    (reset at the start) minus the allocated at the start; on CPU the process's peak RSS, sampled by a
    thread every millisecond, minus the RSS at the start. glibc keeps freed memory for reuse, in RSS:
    it is handed back first (malloc_trim), else what earlier work left would hide this block's peak."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.peak = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            import psutil

            release_freed_memory()
            self.process = psutil.Process()
            self.start = self.highest = self.process.memory_info().rss
            self.done = threading.Event()
            self.thread = threading.Thread(target=self.sample, daemon=True)
            self.thread.start()
        return self

    def sample(self):
        while not self.done.wait(0.001):
            self.highest = max(self.highest, self.process.memory_info().rss)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.start
        else:
            self.done.set()
            self.thread.join()
            self.peak = max(self.highest, self.process.memory_info().rss) - self.start


def release_freed_memory() -> None:
    """glibc's malloc_trim(0): return the heap's free memory to the OS (nothing elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def clock(device) -> float:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def layer_bytes(layer: dict) -> int:
    return sum(v.numel() * v.element_size() for v in layer.values() if torch.is_tensor(v))


@torch.no_grad()
def measure_decode(lm, context: int, decode_tokens: int, seed: int, device) -> dict:
    """One prompt of `context` random tokens: prefill = one forward that builds the DecodeCache
    (use_cache=True, logits of the last position only, as generate's first step), then decode_tokens
    greedy one-token steps from that cache (as generate's later steps). tokens/s = tokens / wall time;
    cache bytes per layer after the prefill (every tensor the layer keeps); peak memory over both
    (PeakMemory)."""
    prompt = torch.randint(lm.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(seed))
    prompt = prompt.to(device)
    with PeakMemory(device) as memory:
        start = clock(device)
        out = lm(input_ids=prompt, use_cache=True, logits_to_keep=1)
        prefill = clock(device) - start
        cache = out.past_key_values
        per_layer = [layer_bytes(layer) for layer in cache.layers]
        token = out.logits[:, -1:].argmax(-1)
        start = clock(device)
        for _ in range(decode_tokens):
            out = lm(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
        decode = clock(device) - start
    return {"prefill_tokens_per_sec": context / prefill, "decode_tokens_per_sec": decode_tokens / decode,
            "peak_mem_bytes": memory.peak, "cache_bytes": sum(per_layer), "cache_bytes_per_layer": per_layer}


def decode_suite(lm, contexts: list[int], decode_tokens: int, seed: int, device) -> dict:
    """measure_decode at each context, after one short warm-up (16-token prefill, 2 steps: first-call
    costs out of the first row), past max_position_embeddings too (cost only: the module docstring); a
    context that runs out of memory is a row with the reason under "skipped"."""
    measure_decode(lm, 16, 2, seed, device)
    rows = []
    for context in contexts:
        reason = None
        try:
            with positions_up_to(lm, context + decode_tokens):
                row = {"context": context, **measure_decode(lm, context, decode_tokens, seed, device)}
        except torch.OutOfMemoryError as e:
            reason = f"out of memory: {first_line(e)}"
        if reason is not None:
            rows.append({"context": context, "skipped": reason})
            print(f"decode {context}: skipped, {reason}")
            continue
        rows.append(row)
        print(f"decode {context}: prefill {row['prefill_tokens_per_sec']:.0f} tok/s, decode "
              f"{row['decode_tokens_per_sec']:.1f} tok/s, cache {row['cache_bytes'] / 2**20:.2f} MiB, "
              f"peak {row['peak_mem_bytes'] / 2**20:.1f} MiB")
    return {"contexts": list(contexts), "rows": rows}


def decode_scores(report: dict) -> dict[str, float]:
    """Peak memory in GB (1e9 bytes)."""
    out = {}
    for row in report["rows"]:
        if "skipped" not in row:
            t = row["context"]
            out.update({f"decode/prefill_tokens_per_sec@{t}": row["prefill_tokens_per_sec"],
                        f"decode/tokens_per_sec@{t}": row["decode_tokens_per_sec"],
                        f"decode/peak_mem_gb@{t}": row["peak_mem_bytes"] / 1e9,
                        f"decode/cache_bytes@{t}": row["cache_bytes"]})
    return out


def plot_decode(report: dict, title: str, path: Path) -> Path:
    """Prefill and decode tokens/s, and cache bytes, against the context (log-log)."""
    plt = pyplot()
    rows = [r for r in report["rows"] if "skipped" not in r]
    contexts = [r["context"] for r in rows]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(10, 4))
    speed.plot(contexts, [r["prefill_tokens_per_sec"] for r in rows], "o-", label="prefill")
    speed.plot(contexts, [r["decode_tokens_per_sec"] for r in rows], "o-", label="decode")
    speed.set_ylabel("tokens/s")
    speed.legend()
    memory.plot(contexts, [r["cache_bytes"] for r in rows], "o-", label="decode cache")
    memory.plot(contexts, [max(r["peak_mem_bytes"], 1) for r in rows], "o--", label="peak memory")
    memory.set_ylabel("bytes")
    memory.legend()
    for ax in (speed, memory):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
    fig.suptitle(f"{title}: decoding")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- eval.py's entry -----------------------------------------------------------------------------
def run_suites(cfg, lm, data, data_cfg, train_seq_len: int, device, out: Path,
               title: str) -> tuple[dict, dict, list[Path]]:
    """The suites cfg.suite names, with eval.py's options: (report parts, scores, PNGs written to out)."""
    from data import build_data

    report, scores, images = {}, {}, []
    if "length" in cfg.suite:
        def val_at(length: int) -> Split:
            if data.tokenizer is None:  # MQAR: only query labels; the recall suite measures it at longer seq_len
                raise ValueError("synthetic data (no text to score)")
            return build_data(data_cfg, length, cfg.seed).val

        report["length"] = length_suite(lm, val_at, train_seq_len, list(cfg.length_factors), cfg.length_batches,
                                        cfg.batch_size * train_seq_len, device)
        scores.update(length_scores(report["length"]))
        if report["length"]["seq_lens"]:
            images.append(plot_length(report["length"], title, out / "length_loss.png"))
    if "recall" in cfg.suite:
        if data_cfg.name == "mqar":
            kv_pairs = sorted({s.num_kv_pairs for s in data_cfg.test})
            report["recall"] = mqar_suite(lm, data_cfg, [k * train_seq_len for k in cfg.length_factors], kv_pairs,
                                          cfg.mqar_examples, cfg.seed, device)
        else:
            report["recall"] = recall_suite(lm, data.tokenizer, data.val, list(cfg.recall_contexts),
                                            list(cfg.recall_depths), cfg.recall_trials, cfg.seed, device)
        scores.update(recall_scores(report["recall"]))
        if report["recall"].get("contexts", True):  # a passkey grid with every context skipped has nothing to draw
            images.append(plot_recall(report["recall"], title, out / "recall_heatmap.png"))
    if "decode" in cfg.suite:
        report["decode"] = decode_suite(lm, list(cfg.decode_contexts), cfg.decode_tokens, cfg.seed, device)
        scores.update(decode_scores(report["decode"]))
        images.append(plot_decode(report["decode"], title, out / "decode.png"))
    return report, scores, images
