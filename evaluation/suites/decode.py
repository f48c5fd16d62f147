"""The decode suite: prefill tokens/s, decode tokens/s at several batch sizes, each phase's peak memory and the
decode-cache bytes against the context, measured on random tokens (positions past max_position_embeddings too:
evaluation/context.py)."""
import copy
import ctypes
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common.plots import legend_outside, pyplot, save_figure
from evaluation.context import first_line, positions_up_to
from evaluation.suites import SUITES, EvalPoint, Suite, mean
from model.options import option


@dataclass
class DecodeOptions:
    contexts: list[int] = option([512, 1024, 2048, 4096, 8192, 16384], at_least=1)  # prompt lengths (tokens)
    tokens: int = option(32, at_least=1)  # greedy single-token steps after each prompt
    batch_sizes: list[int] = option([1, 8, 32], at_least=1)  # rows decoded at once (the prompt's cache repeated)


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


@torch.no_grad()
def measure_decode(lm, context: int, decode_tokens: int, batch_sizes: list[int], seed: int, device) -> dict:
    """One prompt of `context` random tokens: prefill = one forward that builds the DecodeCache (use_cache=True,
    logits of the last position only, as generate's first step); then, per batch size b, that cache repeated
    into b rows and decode_tokens greedy one-token steps from it (as generate's later steps; rows alike cost
    what distinct rows would). tokens/s = tokens decoded (b per step) / wall time; the cache's bytes per layer
    after the prefill (one row); peak memory of each phase apart (PeakMemory: the prefill's transients, then
    each decode's growth of its cache and its transients). The row's decode_* fields are batch_sizes[0]'s."""
    prompt = torch.randint(lm.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(seed))
    prompt = prompt.to(device)
    with PeakMemory(device) as memory:
        start = clock(device)
        out = lm(input_ids=prompt, use_cache=True, logits_to_keep=1)
        prefill = clock(device) - start
    cache, first = out.past_key_values, out.logits[:, -1:].argmax(-1)
    del out
    per_layer = cache.layer_nbytes()
    batches = []
    for batch in batch_sizes:
        rows = copy.deepcopy(cache)
        rows.reorder_cache(torch.zeros(batch, dtype=torch.long, device=device))
        token = first.expand(batch, 1)
        with PeakMemory(device) as memory_decode:
            start = clock(device)
            for _ in range(decode_tokens):
                token = lm(input_ids=token, past_key_values=rows, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
            decode = clock(device) - start
        del rows
        batches.append({"batch": batch, "tokens_per_sec": batch * decode_tokens / decode,
                        "peak_mem_bytes": memory_decode.peak})
    return {"prefill_tokens_per_sec": context / prefill, "prefill_peak_mem_bytes": memory.peak,
            "decode_tokens_per_sec": batches[0]["tokens_per_sec"], "decode_peak_mem_bytes": batches[0]["peak_mem_bytes"],
            "cache_bytes": sum(per_layer), "cache_bytes_per_layer": per_layer, "batches": batches}


def decode_costs(lm, contexts: list[int], decode_tokens: int, batch_sizes: list[int], seed: int, device) -> dict:
    """measure_decode at each context, after one short warm-up (16-token prefill, 2 steps: first-call
    costs out of the first row), past max_position_embeddings too (cost only: the module docstring); a
    context that runs out of memory is a row with the reason under "skipped"."""
    measure_decode(lm, 16, 2, batch_sizes[:1], seed, device)
    rows = []
    for context in contexts:
        reason = None
        try:
            with positions_up_to(lm, context + decode_tokens):
                row = {"context": context, **measure_decode(lm, context, decode_tokens, batch_sizes, seed, device)}
        except torch.OutOfMemoryError as e:
            reason = f"out of memory: {first_line(e)}"
        if reason is not None:
            rows.append({"context": context, "skipped": reason})
            print(f"decode {context}: skipped, {reason}")
            continue
        rows.append(row)
        decoded = ", ".join(f"{b['tokens_per_sec']:.1f} at batch {b['batch']} (peak {b['peak_mem_bytes'] / 2**20:.1f} MiB)"
                            for b in row["batches"])
        print(f"decode {context}: prefill {row['prefill_tokens_per_sec']:.0f} tok/s (peak "
              f"{row['prefill_peak_mem_bytes'] / 2**20:.1f} MiB), cache {row['cache_bytes'] / 2**20:.2f} MiB; decode tok/s "
              f"{decoded}")
    return {"contexts": list(contexts), "rows": rows}


def plot_decode(report: dict, title: str, path: Path) -> Path:
    """Prefill tokens/s and decode tokens/s per batch size; the cache's bytes and each phase's peak memory
    (decode at the first batch size); against the context (log-log)."""
    plt = pyplot()
    rows = [r for r in report["rows"] if "skipped" not in r]
    contexts = [r["context"] for r in rows]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(10, 4))
    speed.plot(contexts, [r["prefill_tokens_per_sec"] for r in rows], "o-", label="prefill")
    batches = [b["batch"] for b in rows[0]["batches"]] if rows else []
    for i, batch in enumerate(batches):
        speed.plot(contexts, [r["batches"][i]["tokens_per_sec"] for r in rows], "o-", label=f"decode, batch {batch}")
    speed.set_ylabel("tokens/s")
    speed.legend()
    memory.plot(contexts, [r["cache_bytes"] for r in rows], "o-", label="decode cache")
    memory.plot(contexts, [max(r["prefill_peak_mem_bytes"], 1) for r in rows], "o--", label="prefill peak")
    memory.plot(contexts, [max(r["decode_peak_mem_bytes"], 1) for r in rows], "o:",
                label=f"decode peak, batch {batches[0]}" if batches else "decode peak")
    memory.set_ylabel("bytes")
    memory.legend()
    for ax in (speed, memory):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
    fig.suptitle(f"{title}: decoding")
    return save_figure(fig, path)


def decode_rows(report: dict) -> dict:
    """The decode suite's measured rows by context (skipped contexts left out)."""
    return {r["context"]: r for r in (report.get("decode") or {}).get("rows", []) if "skipped" not in r and "context" in r}


@SUITES.register("decode")
class Decode(Suite):
    Options = DecodeOptions
    quick_options = {"contexts": [32, 64], "tokens": 2, "batch_sizes": [1, 2]}

    def run(self, ctx, opts: DecodeOptions) -> dict:
        return decode_costs(ctx.lm, opts.contexts, opts.tokens, opts.batch_sizes, ctx.seed, ctx.device)

    def scores(self, block: dict) -> dict[str, float]:
        """Peak memory in GB (1e9 bytes); decode figures at batch 1 unsuffixed, at batch b > 1 with _batch<b>."""
        out = {}
        for row in block["rows"]:
            if "skipped" not in row:
                t = row["context"]
                out.update({f"decode/prefill_tokens_per_sec@{t}": row["prefill_tokens_per_sec"],
                            f"decode/prefill_peak_mem_gb@{t}": row["prefill_peak_mem_bytes"] / 1e9,
                            f"decode/cache_bytes@{t}": row["cache_bytes"]})
                for b in row["batches"]:
                    suffix = "" if b["batch"] == 1 else f"_batch{b['batch']}"
                    out.update({f"decode/tokens_per_sec@{t}{suffix}": b["tokens_per_sec"],
                                f"decode/peak_mem_gb@{t}{suffix}": b["peak_mem_bytes"] / 1e9})
        return out

    def plot(self, block: dict, title: str, folder: Path) -> list[Path]:
        return [plot_decode(block, title, Path(folder) / "decode.png")]

    def compare(self, points: list[EvalPoint], out: Path, style) -> tuple[list[Path], list[str], list[str]]:
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
