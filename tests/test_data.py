"""Data: determinism, packing with EOS between documents, the split, local files, clear errors."""
import json

import pytest
import torch
from omegaconf import OmegaConf

from data import build_data
from data.text import stdlib_documents


def stdlib_cfg(cache, **kw):
    return OmegaConf.create({"name": "stdlib", "tokenizer": "bpe", "vocab_size": 384, "val_fraction": 0.2,
                             "max_documents": 25, "cache_dir": str(cache), **kw})


def test_stdlib_corpus_is_the_standard_library_without_tests():
    cfg = stdlib_cfg("/unused", max_documents=None, val_fraction=0.05)
    train, val, _ = stdlib_documents(cfg)
    size = sum(len(d.encode()) for d in train + val)
    assert 5e6 < size < 30e6  # ~12 MB on CPython 3.11
    assert 0.01 < len(val) / (len(train) + len(val)) < 0.15
    again = stdlib_documents(cfg)
    assert again[0] == train and again[1] == val  # deterministic split and order


def test_packing_deterministic_and_eos_separated(tmp_path):
    a = build_data(stdlib_cfg(tmp_path / "a"), 32, seed=0)
    b = build_data(stdlib_cfg(tmp_path / "b"), 32, seed=0)  # a fresh cache: tokenizer retrained
    assert torch.equal(a.train.input_ids, b.train.input_ids) and torch.equal(a.val.input_ids, b.val.input_ids)
    c = build_data(stdlib_cfg(tmp_path / "a"), 32, seed=0)  # from the cache
    assert torch.equal(a.train.input_ids, c.train.input_ids)
    tok = a.tokenizer
    flat = a.train.input_ids.flatten()
    docs, _, _ = stdlib_documents(stdlib_cfg(tmp_path))
    first = tok(docs[0], add_special_tokens=False)["input_ids"]
    assert flat[: len(first)].tolist() == first and flat[len(first)].item() == tok.eos_token_id
    assert tok.decode(first) == docs[0]  # byte-level BPE round-trips the text exactly
    assert a.train.input_ids.shape[1] == 32 and a.bytes_per_token > 1


def test_local_txt_jsonl_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document number {i} " * 20 for i in range(40)]
    (tmp_path / "txt").mkdir()
    for i, t in enumerate(texts):
        (tmp_path / "txt" / f"{i:03d}.txt").write_text(t)
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in texts))
    pq.write_table(pa.table({"body": texts}), tmp_path / "d.parquet")
    blocks = {}
    for path, column in [(tmp_path / "txt", "text"), (tmp_path / "d.jsonl", "body"), (tmp_path / "d.parquet", "body")]:
        cfg = OmegaConf.create({"name": "local", "path": str(path), "text_column": column, "max_documents": None,
                                "val_fraction": 0.1, "tokenizer": "bpe", "vocab_size": 300, "cache_dir": str(tmp_path / "c")})
        d = build_data(cfg, 16, seed=0)
        assert len(d.val) > 0
        blocks[path.suffix] = d.train.input_ids
    assert torch.equal(blocks[".jsonl"], blocks[".parquet"])  # same documents, same blocks


def test_data_errors(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    cfg = OmegaConf.create({"name": "local", "path": str(tmp_path / "d.jsonl"), "text_column": "text", "max_documents": None,
                            "val_fraction": 0.1, "tokenizer": "bpe", "vocab_size": 300, "cache_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="has no text column 'text'; its columns: body"):
        build_data(cfg, 16, 0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_data(OmegaConf.merge(cfg, {"path": str(tmp_path / "missing.txt")}), 16, 0)
    with pytest.raises(ValueError, match="unknown data 'nope'; valid: "):
        build_data(OmegaConf.merge(cfg, {"name": "nope"}), 16, 0)
