"""Data pipeline at scale, side by side with the nanoGPT-style peer, on a generated corpus.

The corpus: this Python's standard library source (no network), repeated into parquet shards of
documents until it holds 500 MB of text (50 MB with --quick), plus a 5 MB one. One byte-level BPE
(trained once on the stdlib) serves both pipelines, so they do the same tokenization work:
- ours: data=local through data/text.py (datasets.map with num_proc=2 -> the flat token store);
- the peer, as nanoGPT's prepare.py: datasets.map(num_proc=2) to ids + lengths, then one uint16
  np.memmap written shard by shard.
Each runs in a fresh process with a fresh datasets cache; we report wall time and peak RSS (the
main process and its largest worker). Then: the resident memory of a training process at its first
step with the 500 MB store against the 5 MB one, and the loader's throughput (batches assembled per
second, with and without document positions) against the default model's training tokens/s.
"""
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "outputs" / "bench" / "data"

# Peak anonymous memory of a preparing process, sampled every 0.1 s (prepended to both scripts).
SAMPLER = textwrap.dedent('''
    import threading, time
    def anon_mb():  # this process's anonymous resident memory (no file-backed mmap pages), MB
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    peak_anon = [0.0]
    def sample():
        while True:
            peak_anon[0] = max(peak_anon[0], anon_mb())
            time.sleep(0.1)
    threading.Thread(target=sample, daemon=True).start()
''')

PEER = SAMPLER + textwrap.dedent('''
    import json, resource, sys, time
    import numpy as np
    from datasets import load_dataset
    from transformers import AutoTokenizer
    corpus, tok_dir, out = sys.argv[1:4]
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    eos = tok.eos_token_id
    ds = load_dataset("parquet", data_files=sorted(__import__("glob").glob(corpus + "/*.parquet")), split="train")
    def process(batch):
        ids = [x + [eos] for x in tok(batch["text"], add_special_tokens=False)["input_ids"]]
        return {"ids": ids, "len": [len(x) for x in ids]}
    ds = ds.map(process, batched=True, num_proc=2, remove_columns=["text"])
    total = int(np.sum(ds["len"], dtype=np.uint64))
    arr = np.memmap(out, dtype=np.uint16, mode="w+", shape=(total,))
    idx, shards = 0, 64
    for i in range(shards):
        batch = ds.shard(num_shards=shards, index=i, contiguous=True).with_format("numpy")
        chunk = np.concatenate(batch["ids"])
        arr[idx:idx + len(chunk)] = chunk
        idx += len(chunk)
    arr.flush()
    print(json.dumps({"seconds": time.time() - t0, "tokens": total,
                      "rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "anon_main_mb": peak_anon[0],
                      "rss_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
''')

OURS = SAMPLER + textwrap.dedent('''
    import json, resource, sys, time
    from omegaconf import OmegaConf
    from data import build_data  # cwd: the repo
    corpus, tok_dir, cache = sys.argv[1:4]
    t0 = time.time()
    cfg = OmegaConf.create({"name": "local", "path": corpus, "text_column": "text", "max_documents": None,
                            "val_fraction": 0.01, "tokenizer": tok_dir, "vocab_size": None, "cache_dir": cache,
                            "document_mask": True, "num_proc": 2})
    d = build_data(cfg, 256, 0)
    print(json.dumps({"seconds": time.time() - t0,
                      "tokens": d.train.store.meta["num_tokens"] + d.val.store.meta["num_tokens"],
                      "rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "anon_main_mb": peak_anon[0],
                      "rss_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
''')


def make_corpus(folder: Path, target_bytes: int) -> Path:
    """Parquet shards of stdlib files (each copy prefixed with its copy number), ~10 MB each."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from omegaconf import OmegaConf

    from data.text import stdlib_documents

    done = folder / "DONE"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    train, val, _ = stdlib_documents(OmegaConf.create({"max_documents": None, "val_fraction": 0.05}))
    docs = train + val
    written, shard, copy, batch = 0, 0, 0, []
    while written < target_bytes:
        for doc in docs:
            text = f"# copy {copy}\n{doc}"
            batch.append(text)
            written += len(text.encode())
            if sum(map(len, batch)) > 10_000_000 or written >= target_bytes:
                pq.write_table(pa.table({"text": batch}), folder / f"shard-{shard:04d}.parquet")
                shard, batch = shard + 1, []
            if written >= target_bytes:
                break
        copy += 1
    done.write_text(str(written))
    return folder


def run_script(code: str, *args: str, hf_cache: Path) -> dict:
    env = {**os.environ, "HF_DATASETS_CACHE": str(hf_cache), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def train_rss_mb(corpus: Path, tok_dir: Path, cache: Path, run_dir: Path, hf_cache: Path) -> float:
    """Peak RSS (MB) of train.py at its first logged step (the store already built)."""
    cmd = [sys.executable, str(ROOT / "train.py"), "data=local", f"data.path={corpus}", f"data.tokenizer={tok_dir}",
           "data.val_fraction=0.01", f"data.cache_dir={cache}", "logger=none", "trainer.max_steps=1", "trainer.warmup_steps=0",
           "trainer.log_every=1", "trainer.eval_every=1", "trainer.eval_batches=1", "trainer.sample_tokens=0",
           f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_DATASETS_CACHE": str(hf_cache)})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    return first["perf/peak_mem_gb"] * 1e3


def loader_throughput(corpus: Path, tok_dir: Path, cache: Path, seconds: float) -> dict:
    """Batches of 8 x 256 assembled per second (global_batch + TokenWindows.batch) over `seconds`, with
    and without document positions."""
    from omegaconf import OmegaConf

    from data import build_data
    from data.batches import global_batch

    out = {}
    for mask in (False, True):
        cfg = OmegaConf.create({"name": "local", "path": str(corpus), "text_column": "text", "max_documents": None,
                                "val_fraction": 0.01, "tokenizer": str(tok_dir), "vocab_size": None,
                                "cache_dir": str(cache), "document_mask": mask, "num_proc": 2})
        train = build_data(cfg, 256, 0).train
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            train.batch(global_batch(steps, len(train), 8, 0))
            steps += 1
        out[mask] = steps / (time.perf_counter() - t0)
    return out


def default_model_tokens_per_sec(steps: int) -> float:
    """fwd + bwd + AdamW tokens/s of the default model (configs/model/tiny.yaml shape, batch 8 x 256):
    the median of `steps` steps after the first."""
    import torch
    from omegaconf import OmegaConf

    from model import DecoderLM, LMConfig

    m = OmegaConf.load(ROOT / "configs" / "model" / "tiny.yaml")
    lm = DecoderLM(LMConfig(vocab_size=8192, hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
                            num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                            intermediate_size=m.intermediate_size))
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    ids = torch.randint(0, 8192, (8, 256))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        lm(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return 8 * 256 / sorted(times[1:])[len(times[1:]) // 2]


def preparation_row(name: str, r: dict) -> list[str]:
    """A table row of one preparing process's figures (run_script's JSON)."""
    return [name, f"{r['seconds']:.1f}", f"{r['rss_main_mb']:.0f}", f"{r['anon_main_mb']:.0f}", f"{r['rss_worker_mb']:.0f}",
            f"{r['tokens']:,}"]


def run(quick: bool) -> str:
    from omegaconf import OmegaConf

    from data.text import build_tokenizer, stdlib_corpus
    from scripts.benchmarks.common import markdown_table

    os.environ.setdefault("HF_DATASETS_CACHE", str(WORK / "hf_cache"))  # before datasets is imported here
    big_bytes = 50_000_000 if quick else 500_000_000
    big = make_corpus(WORK / f"corpus_{big_bytes // 1_000_000}MB", big_bytes)
    small = make_corpus(WORK / "corpus_5MB", 5_000_000)
    cfg = OmegaConf.create({"name": "stdlib", "max_documents": None, "val_fraction": 0.05, "tokenizer": "bpe",
                            "vocab_size": 8192})
    tok = build_tokenizer(cfg, stdlib_corpus(cfg), WORK / "tokenizer_cache")
    tok_dir = WORK / "tokenizer"
    tok.save_pretrained(tok_dir)

    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
        tmp = Path(tmp)
        peer = run_script(PEER, str(big), str(tok_dir), str(tmp / "peer.bin"), hf_cache=tmp / "hf_peer")
        ours = run_script(OURS, str(big), str(tok_dir), str(tmp / "ours"), hf_cache=tmp / "hf_ours")
        ours_small = run_script(OURS, str(small), str(tok_dir), str(tmp / "ours_small"), hf_cache=tmp / "hf_small")
        rss_big = train_rss_mb(big, tok_dir, tmp / "ours", tmp / "run_big", tmp / "hf_ours")
        rss_small = train_rss_mb(small, tok_dir, tmp / "ours_small", tmp / "run_small", tmp / "hf_small")
        loader = loader_throughput(big, tok_dir, tmp / "ours", 0.5 if quick else 2.0)
    model_tok_s = default_model_tokens_per_sec(2 if quick else 5)

    gb = big_bytes / 1e9
    rows = [preparation_row("peer (nanoGPT prepare: map num_proc=2 + uint16 memmap)", peer),
            preparation_row("ours (data=local -> token store, num_proc=2)", ours),
            preparation_row("ours, the 5 MB corpus", ours_small)]
    report = [f"Preparation of a {gb:.2f} GB parquet corpus (stdlib copies), one BPE-8192 tokenizer, 2 processes:", "",
              markdown_table(["pipeline", "wall s", "peak RSS main MB", "of it anonymous (no mmap pages) MB",
                              "peak RSS worker MB", "tokens"], rows), "",
              f"ours / peer: time {ours['seconds'] / peer['seconds']:.2f}x, main RSS "
              f"{ours['rss_main_mb'] / peer['rss_main_mb']:.2f}x, worker RSS {ours['rss_worker_mb'] / peer['rss_worker_mb']:.2f}x", "",
              markdown_table(["train.py peak RSS at step 1", "MB"],
                             [[f"{gb:.2f} GB corpus", f"{rss_big:.0f}"], ["5 MB corpus", f"{rss_small:.0f}"],
                              ["difference", f"{rss_big - rss_small:.0f}"]]), "",
              markdown_table(["loader (8 x 256 per batch)", "batches/s", "tokens/s", "x default model's training tokens/s"],
                             [[f"document positions {'on' if mask else 'off'}", f"{b:.0f}", f"{b * 2048:,.0f}",
                               f"{b * 2048 / model_tok_s:.0f}x"] for mask, b in loader.items()]), "",
              f"(default model, fwd+bwd+AdamW at batch 8 x 256: {model_tok_s:,.0f} tokens/s in this run)"]
    return "\n".join(report)


def prepare_ours(sizes_mb: list[int]) -> str:
    """Our preparation alone on the generated corpora of these sizes (MB): wall time, peak RSS and
    peak anonymous memory of the preparing process, to show what does and does not grow with the corpus."""
    rows = []
    for mb in sizes_mb:
        corpus = make_corpus(WORK / f"corpus_{mb}MB", mb * 1_000_000)
        with tempfile.TemporaryDirectory(dir=WORK) as tmp:
            r = run_script(OURS, str(corpus), str(WORK / "tokenizer"), str(Path(tmp) / "ours"),
                           hf_cache=Path(tmp) / "hf")
        rows.append(preparation_row(f"{mb} MB", r))
    from scripts.benchmarks.common import markdown_table

    return markdown_table(["corpus", "wall s", "peak RSS main MB", "of it anonymous MB", "peak RSS worker MB", "tokens"], rows)


def main(argv: list[str] | None = None) -> None:
    """python -m scripts.benchmarks.data 5 50 500: our preparation alone, per corpus size (after one
    `python scripts/bench.py data`, which writes the tokenizer)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("sizes_mb", nargs="+", type=int, help="corpus sizes in MB")
    print(prepare_ours(p.parse_args(argv).sizes_mb))


if __name__ == "__main__":
    main()
