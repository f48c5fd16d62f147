"""Text corpora -> tokenizer -> token stores (train, val) -> fixed-length windows.

Sources: `stdlib` (this Python's standard library source, found with sysconfig, without
site-packages and test folders, files in sorted order, train/val split by a hash of each file's
relative path), `hf` (a hub dataset by name/config/split/text column; `streaming=true` takes the
first `max_tokens` without downloading the rest) and `local` (.txt/.jsonl/.parquet files or a folder
of them). Each source gives `datasets` datasets, never Python lists of the corpus: they are
tokenized with `datasets.map(batched=True, num_proc=...)` (its parallelism, its arrow files) and
written once to a token store (data/store.py) under a key of (source, tokenizer, split), which
every rank then memory-maps. The tokenizer is a byte-level BPE trained on the train split (cached)
or any transformers tokenizer by name.
"""
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock

from common.files import written_then_renamed
from data.registry import DATASETS
from data.store import STORE_VERSION, StoreWriter, TokenStore, TokenWindows, store_problem
from data.types import Data

EOS = "<|endoftext|>"
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
BATCH = 1000  # documents per tokenizer call


@dataclass
class Corpus:
    """train / val: datasets.Dataset (IterableDataset when streaming) with a text column; val None
    means: hold out a deterministic share of the train documents."""
    train: object
    val: object | None
    column: str
    fingerprint: str
    streaming: bool = False


# ---- sources -------------------------------------------------------------------------------------
def stdlib_documents(cfg) -> tuple[list[str], list[str], str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        paths += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    paths.sort()
    if cfg.max_documents:
        paths = paths[: cfg.max_documents]
    train, val = [], []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        # Split by file, deterministically: a file is in val iff crc32(relative path) % 1000 < 1000 * val_fraction.
        (val if zlib.crc32(rel.encode()) % 1000 < 1000 * cfg.val_fraction else train).append(text)
    sizes = hashlib.sha1("".join(f"{p.relative_to(root)}:{p.stat().st_size};" for p in paths).encode())
    return train, val, f"stdlib-{root}-{sizes.hexdigest()}-{cfg.val_fraction}"


def stdlib_corpus(cfg) -> Corpus:
    """The embedded default corpus (small enough to read into memory, then handed on as datasets)."""
    import datasets

    train, val, fingerprint = stdlib_documents(cfg)
    return Corpus(datasets.Dataset.from_dict({"text": train}), datasets.Dataset.from_dict({"text": val}),
                  "text", fingerprint)


def _check_column(dataset, column: str, where: str) -> None:
    names = dataset.column_names  # None for a stream whose features are unknown until read
    if names is not None and column not in names:
        raise ValueError(f"{where} has no text column {column!r}; its columns: {', '.join(names)}")


def hf_corpus(cfg) -> Corpus:
    import datasets

    if not cfg.path:
        raise ValueError("data=hf needs data.path=<hub dataset name>, e.g. data.path=roneneldan/TinyStories")
    try:
        splits = datasets.load_dataset(cfg.path, cfg.config, streaming=cfg.streaming)
    except Exception as e:  # not found, unreachable, bad config name: one line instead of a traceback
        reason = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"data.path={cfg.path!r}: cannot load it ({type(e).__name__}: {reason})") from None
    if cfg.split not in splits:
        raise ValueError(f"data.split={cfg.split!r} is not a split of {cfg.path}; its splits: {', '.join(splits)}")
    train = splits[cfg.split]
    val = splits[cfg.val_split] if cfg.val_split in splits else None
    if cfg.val_split and val is None:
        print(f"data: {cfg.path} has no split {cfg.val_split!r}; holding out {cfg.val_fraction:g} of the train documents")
    for part in (train, val):
        if part is not None:
            _check_column(part, cfg.text_column, cfg.path)
    if cfg.max_documents:
        train = train.take(cfg.max_documents) if cfg.streaming else train.select(range(min(cfg.max_documents, len(train))))
    if cfg.streaming and not cfg.max_tokens:
        raise ValueError("data.streaming=true needs data.max_tokens (how many train tokens to take from the stream)")
    return Corpus(train, val, cfg.text_column, f"hf-{cfg.path}-{cfg.config}-{cfg.split}-{cfg.val_split}-"
                  f"{cfg.max_documents}-{cfg.text_column}-{cfg.val_fraction}", streaming=cfg.streaming)


LOCAL_LOADERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def local_corpus(cfg) -> Corpus:
    import datasets

    if not cfg.path:
        raise ValueError("data=local needs data.path=<file or folder of .txt/.jsonl/.parquet>")
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data.path {str(path)!r} does not exist")
    files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_LOADERS) if path.is_dir() else [path]
    if not files or any(f.suffix not in LOCAL_LOADERS for f in files):
        raise ValueError(f"data.path {str(path)!r}: need files ending in {', '.join(LOCAL_LOADERS)}")
    kinds = {LOCAL_LOADERS[f.suffix] for f in files}
    if len(kinds) > 1:
        raise ValueError(f"data.path {str(path)!r} mixes file kinds {sorted(kinds)}; use one kind")
    kind = kinds.pop()
    if kind != "text" and (empty := [f for f in files if f.stat().st_size == 0]):
        raise ValueError(f"data.path {str(path)!r}: {empty[0]} is empty")
    extra = {"sample_by": "document"} if kind == "text" else {}  # a .txt file is one document
    ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train", **extra)
    column = "text" if kind == "text" else cfg.text_column
    _check_column(ds, column, str(path))
    if cfg.max_documents:
        ds = ds.select(range(min(cfg.max_documents, len(ds))))
    stamp = hashlib.sha1("".join(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns};" for f in files).encode())
    return Corpus(ds, None, column, f"local-{stamp.hexdigest()}-{column}-{cfg.max_documents}-{cfg.val_fraction}")


def text_batches(dataset, column: str, max_bytes: int | None = None):
    """Lists of texts from a dataset (or a stream), BATCH at a time, up to about max_bytes."""
    seen = 0
    for batch in dataset.iter(batch_size=BATCH):
        yield batch[column]
        seen += sum(len(t) for t in batch[column])
        if max_bytes and seen >= max_bytes:
            return


# ---- tokenizer -------------------------------------------------------------------------------------
def build_tokenizer(cfg, corpus: Corpus, cache: Path):
    """The run's tokenizer, with a pad token (EOS where it has none): training packs its documents and never pads,
    but an export's users pad batches of prompts (`tok(prompts, padding=True, padding_side="left")`)."""
    from transformers import AutoTokenizer

    if cfg.tokenizer != "bpe":
        tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
        if tok.eos_token is None:
            raise ValueError(f"tokenizer {cfg.tokenizer!r} has no EOS token to separate documents")
    else:
        tok = trained_bpe(cfg, corpus, cache)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def trained_bpe(cfg, corpus: Corpus, cache: Path):
    """A byte-level BPE of cfg.vocab_size trained on the corpus (bpe_train_bytes of it), cached by both."""
    from transformers import PreTrainedTokenizerFast

    sample = cfg.get("bpe_train_bytes")
    key = hashlib.sha1(f"{corpus.fingerprint}-{cfg.vocab_size}-{sample}".encode()).hexdigest()[:16]
    folder = cache / "tokenizers" / key
    if not (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=cfg.vocab_size, special_tokens=[EOS], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        bpe.train_from_iterator(text_batches(corpus.train, corpus.column, sample), trainer=trainer)
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, unk_token=None)
        with written_then_renamed(folder, keep_existing=True) as tmp:  # kept: another process finished first
            tok.save_pretrained(tmp)
    return PreTrainedTokenizerFast.from_pretrained(folder)


# ---- token stores ----------------------------------------------------------------------------------
def encoder(tokenizer, column: str):
    """batched map function: each non-empty text -> its ids + EOS, and its UTF-8 byte count."""
    eos = tokenizer.eos_token_id

    def encode(batch: dict) -> dict:
        texts = [t for t in batch[column] if t]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return {"input_ids": [x + [eos] for x in ids], "num_bytes": [len(t.encode("utf-8")) for t in texts]}

    return encode


def held_out(first: int, count: int, every: int) -> np.ndarray:
    """Which of documents first .. first + count - 1 go to val: every `every`-th (deterministic)."""
    return (first + np.arange(count)) % every == every - 1


def write_stores(folders: dict[str, Path], vocab_size: int, info: dict, feed) -> dict[str, TokenStore]:
    """feed(writers) adds documents to the {split: StoreWriter}; then every store is finished, or on
    any failure every temp folder removed."""
    writers = {split: StoreWriter(folder, vocab_size, {**info, "split": split}) for split, folder in folders.items()}
    try:
        feed(writers)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return {split: w.finish() for split, w in writers.items()}


def map_into(writers: dict, dataset, column: str, tokenizer, num_proc: int, every: int | None, scratch: Path) -> None:
    """datasets.map (batched, num_proc workers, its arrow output under `scratch`) over the dataset,
    then its arrow batches, without Python lists, into the first writer (and, with `every`, every
    `every`-th document into writers["val"])."""
    procs = max(1, min(num_proc, len(dataset) // BATCH))  # a small corpus is not worth worker processes
    tokenized = dataset.map(encoder(tokenizer, column), batched=True, batch_size=BATCH, num_proc=procs,
                            remove_columns=dataset.column_names, cache_file_name=str(scratch / "ids.arrow"),
                            desc="tokenizing")
    target = next(iter(writers))
    seen = 0
    # BATCH documents at a time: slices of the memory-mapped arrow file, so the working set is a
    # batch's ids (and their filtered copy), whatever the corpus size.
    for table in tokenized.with_format("arrow").iter(batch_size=BATCH):
        ids = table.column("input_ids").combine_chunks()
        num_bytes = table.column("num_bytes").to_numpy()
        to_val = held_out(seen, len(ids), every) if every else np.zeros(len(ids), dtype=bool)
        for split, rows in ((target, ~to_val), ("val", to_val)):
            if rows.any():
                part = ids.filter(rows)
                writers[split].add(part.flatten().to_numpy(), part.value_lengths().to_numpy(), num_bytes[rows].sum())
        seen += len(ids)


def stream_into(writers: dict, corpus: Corpus, tokenizer, max_tokens: int, val_fraction: float, every: int) -> None:
    """A streamed corpus, tokenized on the fly: train up to max_tokens, val up to
    val_fraction * max_tokens, from the val stream or, without one, every `every`-th train document."""
    encode = encoder(tokenizer, corpus.column)
    budget = {"train": max_tokens, "val": max(1, int(val_fraction * max_tokens))}

    def feed(stream, route, feeds: set[str]):
        count = 0
        for texts in text_batches(stream, corpus.column):
            encoded = encode({corpus.column: texts})
            for ids, num_bytes in zip(encoded["input_ids"], encoded["num_bytes"]):
                split = route(count)
                if writers[split].num_tokens < budget[split]:
                    writers[split].add(np.asarray(ids), np.array([len(ids)]), num_bytes)
                count += 1
            if all(writers[s].num_tokens >= budget[s] for s in feeds):
                return

    if corpus.val is None:
        feed(corpus.train, lambda i: "val" if i % every == every - 1 else "train", {"train", "val"})
    else:
        feed(corpus.train, lambda i: "train", {"train"})
        feed(corpus.val, lambda i: "val", {"val"})


def prepare_stores(cfg, corpus: Corpus, tokenizer, cache: Path) -> dict[str, TokenStore]:
    """The train and val stores for (source, tokenizer, split): opened if complete, else (re)built."""
    tok_id = hashlib.sha1(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest()[:12]
    max_tokens = cfg.get("max_tokens") if corpus.streaming else None
    key = hashlib.sha1(f"{corpus.fingerprint}-{tok_id}-{max_tokens}-v{STORE_VERSION}".encode()).hexdigest()[:16]
    folders = {split: cache / "stores" / f"{key}-{split}" for split in ("train", "val")}
    folders["train"].parent.mkdir(parents=True, exist_ok=True)
    # One process prepares a key at a time (the jobs of a sweep start together on a cold cache): the
    # others wait, then open what it wrote; so a leftover found under the lock is a killed one's.
    with FileLock(cache / "stores" / f"{key}.lock"):
        return open_or_build_stores(cfg, corpus, tokenizer, folders, tok_id, max_tokens)


def open_or_build_stores(cfg, corpus: Corpus, tokenizer, folders: dict[str, Path], tok_id: str,
                         max_tokens: int | None) -> dict[str, TokenStore]:
    stores = {}
    for split, folder in folders.items():
        for leftover in folder.parent.glob(f"{folder.name}.*"):  # a killed preparation's temp or scratch folder
            shutil.rmtree(leftover, ignore_errors=True)
        if not folder.exists():
            continue
        if problem := store_problem(folder):
            print(f"data: rebuilding the {split} token store: {problem}")
        else:
            stores[split] = TokenStore(folder)
    if len(stores) == len(folders):
        return stores
    # A held-out val split comes from the same pass as train, so the two are written together.
    missing = {s: f for s, f in folders.items() if s not in stores or corpus.val is None}
    info = {"source": corpus.fingerprint, "tokenizer": tok_id}
    every = max(2, round(1 / cfg.val_fraction))
    if corpus.streaming:
        return write_stores(missing, len(tokenizer), info,
                            lambda w: stream_into(w, corpus, tokenizer, max_tokens, cfg.val_fraction, every))
    num_proc = cfg.get("num_proc") or os.cpu_count() or 1
    passes = [("train", missing)] if corpus.val is None else [(s, {s: f}) for s, f in missing.items()]
    for split, targets in passes:
        dataset = corpus.train if split == "train" else corpus.val
        with tempfile.TemporaryDirectory(dir=folders[split].parent, prefix=f"{folders[split].name}.scratch") as scratch:
            stores.update(write_stores(targets, len(tokenizer), info, lambda w: map_into(
                w, dataset, corpus.column, tokenizer, num_proc, every if corpus.val is None else None, Path(scratch))))
    return stores


SOURCES = {"stdlib": stdlib_corpus, "hf": hf_corpus, "local": local_corpus}


def build_text_data(cfg, seq_len: int, seed: int) -> Data:
    cache = Path(cfg.cache_dir).expanduser()
    corpus = SOURCES[cfg.name](cfg)
    tokenizer = build_tokenizer(cfg, corpus, cache)
    stores = prepare_stores(cfg, corpus, tokenizer, cache)
    train, val = (TokenWindows(stores[s], seq_len, cfg.document_mask) for s in ("train", "val"))
    for split, windows in (("train", train), ("val", val)):
        if len(windows) == 0:
            raise ValueError(f"the {split} split's {len(windows.store)} tokens cannot fill one block of "
                             f"seq_len={seq_len}; use more data or a shorter seq_len")
    meta = {s: stores[s].meta for s in stores}
    return Data(
        train=train, val=val, vocab_size=len(tokenizer), tokenizer=tokenizer,
        bytes_per_token=meta["val"]["utf8_bytes"] / meta["val"]["num_tokens"],
        info={"train_documents": meta["train"]["num_documents"], "val_documents": meta["val"]["num_documents"],
              "train_tokens": len(train) * seq_len, "val_tokens": len(val) * seq_len,
              "document_mask": bool(cfg.document_mask)},
    )


for _name in SOURCES:
    DATASETS.register(_name)(build_text_data)
