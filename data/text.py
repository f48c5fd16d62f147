"""Text corpora -> tokenizer -> documents joined with EOS -> fixed-length blocks, cached on disk.

Sources: `stdlib` (this Python's standard library source, found with sysconfig, without
site-packages and test folders, files in sorted order, train/val split by a hash of each file's
relative path), `hf` (a hub dataset by name/config/split/text column, streaming allowed) and `local`
(.txt/.jsonl/.parquet files or a folder of them). The tokenizer is a byte-level BPE trained on the
train split (cached) or any transformers tokenizer by name.
"""
import hashlib
import json
import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import torch

from data.registry import DATASETS
from data.types import Data, Split

EOS = "<|endoftext|>"
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# ---- sources: each returns (train_docs, val_docs, fingerprint) -----------------------------------
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


def _column(dataset, column: str, where: str) -> list[str]:
    names = dataset.column_names or []
    if column not in names:
        raise ValueError(f"{where} has no text column {column!r}; its columns: {', '.join(names)}")
    return list(dataset[column])


def _hold_out(docs: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """Every round(1/fraction)-th document goes to val (deterministic, order-preserving)."""
    every = max(2, round(1 / fraction))
    return ([d for i, d in enumerate(docs) if i % every != every - 1],
            [d for i, d in enumerate(docs) if i % every == every - 1])


def hf_documents(cfg) -> tuple[list[str], list[str], str]:
    import datasets

    if not cfg.path:
        raise ValueError("data=hf needs data.path=<hub dataset name>, e.g. data.path=roneneldan/TinyStories")

    def load(split: str) -> list[str]:
        ds = datasets.load_dataset(cfg.path, cfg.config, split=split, streaming=cfg.streaming)
        if cfg.streaming:
            if cfg.text_column not in (ds.column_names or [cfg.text_column]):
                raise ValueError(f"{cfg.path} has no text column {cfg.text_column!r}; its columns: {', '.join(ds.column_names)}")
            rows = ds.take(cfg.max_documents) if cfg.max_documents else ds
            return [row[cfg.text_column] for row in rows]
        if cfg.max_documents:
            ds = ds.select(range(min(cfg.max_documents, len(ds))))
        return _column(ds, cfg.text_column, cfg.path)

    train = load(cfg.split)
    val = load(cfg.val_split) if cfg.val_split else None
    if val is None:
        train, val = _hold_out(train, cfg.val_fraction)
    return train, val, f"hf-{cfg.path}-{cfg.config}-{cfg.split}-{cfg.val_split}-{cfg.max_documents}-{cfg.text_column}"


LOCAL_LOADERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def local_documents(cfg) -> tuple[list[str], list[str], str]:
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
    extra = {"sample_by": "document"} if kind == "text" else {}  # a .txt file is one document
    ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train", **extra)
    docs = _column(ds, "text" if kind == "text" else cfg.text_column, str(path))
    if cfg.max_documents:
        docs = docs[: cfg.max_documents]
    train, val = _hold_out(docs, cfg.val_fraction)
    stamp = hashlib.sha1("".join(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns};" for f in files).encode())
    return train, val, f"local-{stamp.hexdigest()}-{cfg.text_column}-{cfg.max_documents}-{cfg.val_fraction}"


# ---- tokenizer -------------------------------------------------------------------------------------
def build_tokenizer(cfg, train_docs: list[str], fingerprint: str, cache: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if cfg.tokenizer != "bpe":
        tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
        if tok.eos_token is None:
            raise ValueError(f"tokenizer {cfg.tokenizer!r} has no EOS token to separate documents")
        return tok
    key = hashlib.sha1(f"{fingerprint}-{cfg.vocab_size}".encode()).hexdigest()[:16]
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
        bpe.train_from_iterator(train_docs, trainer=trainer)
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, unk_token=None)
        tmp = folder.with_name(f"{key}.tmp{os.getpid()}")
        tok.save_pretrained(tmp)
        tmp.replace(folder) if not folder.exists() else None
    return PreTrainedTokenizerFast.from_pretrained(folder)


# ---- packing ---------------------------------------------------------------------------------------
def pack(docs: list[str], tokenizer, seq_len: int, cache_file: Path) -> torch.Tensor:
    """Concatenate doc_1 EOS doc_2 EOS ... and cut into [N, seq_len] blocks (remainder dropped).
    Cached as .npy (written to a temp name, then renamed)."""
    if not cache_file.exists():
        ids = []
        for start in range(0, len(docs), 1000):
            for doc in tokenizer(docs[start:start + 1000], add_special_tokens=False)["input_ids"]:
                ids.extend(doc)
                ids.append(tokenizer.eos_token_id)
        n = len(ids) // seq_len
        if n == 0:
            raise ValueError(f"{len(ids)} tokens cannot fill one block of seq_len={seq_len}; use more data or a shorter seq_len")
        dtype = np.uint16 if len(tokenizer) <= 65536 else np.int32
        blocks = np.asarray(ids[: n * seq_len], dtype=dtype).reshape(n, seq_len)
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f"{cache_file.stem}.tmp{os.getpid()}.npy")
        np.save(tmp, blocks)
        tmp.replace(cache_file)
    return torch.from_numpy(np.load(cache_file).astype(np.int64))


SOURCES = {"stdlib": stdlib_documents, "hf": hf_documents, "local": local_documents}


def build_text_data(cfg, seq_len: int, seed: int) -> Data:
    cache = Path(cfg.cache_dir).expanduser()
    train_docs, val_docs, fingerprint = SOURCES[cfg.name](cfg)
    if not train_docs or not val_docs:
        raise ValueError(f"data {cfg.name!r} gave {len(train_docs)} train and {len(val_docs)} val documents; need both")
    tokenizer = build_tokenizer(cfg, train_docs, fingerprint, cache)
    tok_id = hashlib.sha1(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest()[:12]
    key = hashlib.sha1(f"{fingerprint}-{tok_id}-{seq_len}".encode()).hexdigest()[:16]
    train = pack(train_docs, tokenizer, seq_len, cache / "tokens" / f"{key}-train.npy")
    val = pack(val_docs, tokenizer, seq_len, cache / "tokens" / f"{key}-val.npy")
    val_bytes = sum(len(d.encode("utf-8")) for d in val_docs)
    val_tokens = sum(len(x) + 1 for x in tokenizer(val_docs, add_special_tokens=False)["input_ids"])
    return Data(
        train=Split(train), val=Split(val), vocab_size=len(tokenizer), tokenizer=tokenizer,
        bytes_per_token=val_bytes / val_tokens,
        info={"train_documents": len(train_docs), "val_documents": len(val_docs),
              "train_tokens": train.numel(), "val_tokens": val.numel()},
    )


for _name in SOURCES:
    DATASETS.register(_name)(build_text_data)
