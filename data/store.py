"""The token store: one split of a corpus, tokenized once, as flat files every rank memory-maps.

    <folder>/tokens.bin      every token of every document, each document followed by EOS
                             (uint16, or uint32 when the vocabulary needs it)
    <folder>/doc_starts.bin  int64 offset of each document's first token
    <folder>/meta.json       dtype, token / document / UTF-8 byte counts, what it was built from;
                             written last

A store is written into a temp folder and renamed, so a killed preparation never leaves a folder
under the final name; a folder whose files disagree with its meta.json is reported and rebuilt.
At train time `TokenWindows` serves fixed-length windows of the flat stream (block i = tokens
[i T, (i + 1) T)) straight from the memory map, with per-document positions when document masking
is on: resident memory does not grow with the corpus.
"""
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from common.files import rename_into_place, temp_path

STORE_VERSION = 1


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def store_problem(folder: Path) -> str | None:
    """None if `folder` is a complete store; else what is wrong with it."""
    meta_file = folder / "meta.json"
    if not meta_file.exists():
        return f"{meta_file} is missing"
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError:
        return f"{meta_file} is not valid JSON"
    if meta.get("version") != STORE_VERSION:
        return f"{folder} has store version {meta.get('version')}, expected {STORE_VERSION}"
    for name, expected in (("tokens.bin", meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize),
                           ("doc_starts.bin", meta["num_documents"] * 8)):
        path = folder / name
        if not path.exists() or path.stat().st_size != expected:
            return f"{path} has {path.stat().st_size if path.exists() else 'no'} bytes, expected {expected}"
    return None


class StoreWriter:
    """Appends tokenized documents to a temp folder; `finish` writes meta.json and renames it."""

    def __init__(self, folder: Path, vocab_size: int, info: dict):
        self.folder, self.info = folder, info
        self.dtype = token_dtype(vocab_size)
        self.tmp = temp_path(folder)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.tokens = (self.tmp / "tokens.bin").open("wb")
        self.starts = (self.tmp / "doc_starts.bin").open("wb")
        self.num_tokens = self.num_documents = self.utf8_bytes = 0

    def add(self, flat_ids: np.ndarray, lengths: np.ndarray, utf8_bytes: int) -> None:
        """Documents given as their concatenated token ids (EOS included) and their lengths."""
        if len(lengths) == 0:
            return
        starts = self.num_tokens + np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64)
        self.tokens.write(np.asarray(flat_ids, dtype=self.dtype).tobytes())
        self.starts.write(starts.tobytes())
        self.num_tokens += int(lengths.sum())
        self.num_documents += len(lengths)
        self.utf8_bytes += int(utf8_bytes)

    def finish(self) -> "TokenStore":
        self.tokens.close()
        self.starts.close()
        if self.num_tokens == 0:
            shutil.rmtree(self.tmp)
            raise ValueError(f"{self.info.get('source', 'the corpus')}: no text to tokenize (every document is empty)")
        meta = {"version": STORE_VERSION, "dtype": np.dtype(self.dtype).name, "num_tokens": self.num_tokens,
                "num_documents": self.num_documents, "utf8_bytes": self.utf8_bytes, **self.info}
        (self.tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        rename_into_place(self.tmp, self.folder)
        return TokenStore(self.folder)

    def abort(self) -> None:
        self.tokens.close()
        self.starts.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class TokenStore:
    """An opened store: memory maps of the token stream and of the document starts."""

    def __init__(self, folder: Path):
        problem = store_problem(folder)
        if problem:
            raise ValueError(f"token store {folder} is unusable: {problem}")
        self.folder = folder
        self.meta = json.loads((folder / "meta.json").read_text())
        self.tokens = np.memmap(folder / "tokens.bin", dtype=self.meta["dtype"], mode="r")
        self.doc_starts = np.memmap(folder / "doc_starts.bin", dtype=np.int64, mode="r")

    def __len__(self) -> int:
        return self.meta["num_tokens"]


class TokenWindows:
    """The Split interface over a store: block i is tokens [i T, (i + 1) T). With document masking,
    each batch also carries position_ids: 0 at the first token of each document segment (a segment
    starts at each EOS, i.e. just before each document, and at the start of the block), +1 within."""

    def __init__(self, store: TokenStore, seq_len: int, document_mask: bool):
        self.store, self.seq_len, self.document_mask = store, seq_len, document_mask

    def __len__(self) -> int:
        return len(self.store) // self.seq_len

    def batch(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        offsets = index.numpy().astype(np.int64)[:, None] * self.seq_len + np.arange(self.seq_len)
        ids = torch.from_numpy(self.store.tokens[offsets].astype(np.int64))
        out = {"input_ids": ids, "labels": ids}
        if self.document_mask:
            # Segments start at 0 and at the EOS before each later document (doc_starts[j] - 1, j >= 1):
            # the latest one <= offset belongs to the last j with doc_starts[j] <= offset + 1.
            starts = self.store.doc_starts
            j = np.searchsorted(starts, offsets + 1, side="right") - 1
            segment = np.where(j >= 1, starts[j] - 1, 0)
            out["position_ids"] = torch.from_numpy(offsets - np.maximum(segment, offsets[:, :1]))
        return out
