"""Data: the token store (flat, memory-mapped, document starts, byte counts), determinism, the
split, local files, streamed and split-less hub datasets (local parquet standing in for the hub),
document positions, the O(batch) sampler, rebuilding a broken cache, clear errors."""
import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from data import build_data
from data.batches import global_batch, permute
from data.text import stdlib_documents


def stdlib_cfg(cache, **kw):
    return OmegaConf.create({"name": "stdlib", "tokenizer": "bpe", "vocab_size": 384, "val_fraction": 0.2,
                             "max_documents": 25, "cache_dir": str(cache), "document_mask": True, **kw})


def local_cfg(path, cache, **kw):
    return OmegaConf.create({"name": "local", "path": str(path), "text_column": "text", "max_documents": None,
                             "val_fraction": 0.1, "tokenizer": "bpe", "vocab_size": 300, "cache_dir": str(cache),
                             "document_mask": True, **kw})


def hf_cfg(path, cache, **kw):
    return OmegaConf.create({"name": "hf", "path": str(path), "config": None, "split": "train", "val_split": "validation",
                             "text_column": "text", "streaming": False, "max_tokens": None, "max_documents": None,
                             "val_fraction": 0.1, "tokenizer": "bpe", "vocab_size": 300, "cache_dir": str(cache),
                             "document_mask": True, **kw})


def blocks(split) -> torch.Tensor:
    return split.batch(torch.arange(len(split)))["input_ids"]


def test_stdlib_corpus_is_the_standard_library_without_tests():
    cfg = stdlib_cfg("/unused", max_documents=None, val_fraction=0.05)
    train, val, _ = stdlib_documents(cfg)
    size = sum(len(d.encode()) for d in train + val)
    assert 5e6 < size < 30e6  # ~12 MB on CPython 3.11
    assert 0.01 < len(val) / (len(train) + len(val)) < 0.15
    again = stdlib_documents(cfg)
    assert again[0] == train and again[1] == val  # deterministic split and order


@pytest.mark.slow
def test_token_store_is_flat_memory_mapped_and_deterministic(tmp_path):
    a = build_data(stdlib_cfg(tmp_path / "a"), 32, seed=0)
    b = build_data(stdlib_cfg(tmp_path / "b"), 32, seed=0)  # a fresh cache: tokenizer retrained
    assert torch.equal(blocks(a.train), blocks(b.train)) and torch.equal(blocks(a.val), blocks(b.val))
    c = build_data(stdlib_cfg(tmp_path / "a"), 32, seed=0)  # from the cache
    assert torch.equal(blocks(a.train), blocks(c.train))
    store = c.train.store
    assert isinstance(store.tokens, np.memmap) and store.tokens.dtype == np.uint16
    assert str(store.tokens.filename).startswith(str(tmp_path / "a"))

    tok = a.tokenizer
    docs, val_docs, _ = stdlib_documents(stdlib_cfg(tmp_path))
    expected = []
    for doc in docs:
        expected += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert store.tokens.tolist() == expected  # doc_1 EOS doc_2 EOS ... in file order
    starts = np.cumsum([0] + [len(tok(d, add_special_tokens=False)["input_ids"]) + 1 for d in docs[:-1]])
    assert store.doc_starts.tolist() == starts.tolist()
    assert tok.decode(expected[: starts[1] - 1]) == docs[0]  # byte-level BPE round-trips the text exactly
    val_meta = a.val.store.meta
    assert val_meta["utf8_bytes"] == sum(len(d.encode()) for d in val_docs)
    assert a.bytes_per_token == pytest.approx(val_meta["utf8_bytes"] / val_meta["num_tokens"])
    assert torch.equal(blocks(a.train).flatten(), torch.tensor(expected[: len(a.train) * 32]))


@pytest.mark.slow
def test_document_positions_restart_at_each_eos(tmp_path):
    data = build_data(stdlib_cfg(tmp_path), 64, seed=0)
    starts = set(data.train.store.doc_starts[1:] - 1)  # the EOS before each later document
    boundary = next(e // 64 for e in sorted(starts) if e % 64)  # a row with a document start inside
    rows = torch.tensor([0, boundary, len(data.train) - 1])
    batch = data.train.batch(rows)
    for r, ids, pos in zip(rows.tolist(), batch["input_ids"], batch["position_ids"]):
        expect, p = [], -1
        for t in range(64):
            offset = r * 64 + t
            p = 0 if (t == 0 or offset in starts) else p + 1
            expect.append(p)
        assert pos.tolist() == expect
    inside = batch["position_ids"][1, 1:] == 0
    assert inside.any() and (batch["input_ids"][1, 1:][inside] == data.tokenizer.eos_token_id).all()
    no_mask = build_data(stdlib_cfg(tmp_path, document_mask=False), 64, seed=0)
    assert "position_ids" not in no_mask.train.batch(rows)


@pytest.mark.slow
def test_local_txt_jsonl_parquet_and_num_proc(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document number {i} " * 20 for i in range(40)]
    (tmp_path / "txt").mkdir()
    for i, t in enumerate(texts):
        (tmp_path / "txt" / f"{i:03d}.txt").write_text(t)
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in texts))
    pq.write_table(pa.table({"body": texts}), tmp_path / "d.parquet")
    out = {}
    for path, column in [(tmp_path / "txt", "text"), (tmp_path / "d.jsonl", "body"), (tmp_path / "d.parquet", "body")]:
        d = build_data(local_cfg(path, tmp_path / "c", text_column=column), 16, seed=0)
        assert len(d.val) > 0
        out[path.suffix] = blocks(d.train)
    assert torch.equal(out[".jsonl"], out[".parquet"])  # same documents, same blocks

    # Enough documents for worker processes: 2 workers write the same store as 1.
    many = [f"line {i} of a corpus with several shards " * (1 + i % 5) for i in range(4000)]
    pq.write_table(pa.table({"text": many}), tmp_path / "many.parquet")
    one = build_data(local_cfg(tmp_path / "many.parquet", tmp_path / "n1", num_proc=1), 16, seed=0)
    two = build_data(local_cfg(tmp_path / "many.parquet", tmp_path / "n2", num_proc=2), 16, seed=0)
    assert np.array_equal(one.train.store.tokens, two.train.store.tokens)
    assert one.train.store.meta["num_documents"] == 3600


def test_hub_dataset_without_val_split_and_streamed(tmp_path):
    """A folder of parquet shards loads through data=hf as a hub dataset would (no validation split,
    as FineWeb): the val split is held out; streamed, only the first max_tokens are tokenized."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    hub = tmp_path / "hub" / "data"
    hub.mkdir(parents=True)
    texts = [f"story {i}: the cat sat on mat number {i % 7}. " * (2 + i % 3) for i in range(600)]
    for shard in range(3):
        pq.write_table(pa.table({"text": texts[shard::3]}), hub / f"train-0000{shard}-of-00003.parquet")
    full = build_data(hf_cfg(hub.parent, tmp_path / "c"), 16, seed=0)
    assert full.info["val_documents"] == 60 and full.info["train_documents"] == 540

    streamed = build_data(hf_cfg(hub.parent, tmp_path / "s", streaming=True, max_tokens=3000), 16, seed=0)
    train, val = streamed.train.store.meta, streamed.val.store.meta
    longest = max(len(streamed.tokenizer(t)["input_ids"]) + 1 for t in texts)
    assert 3000 <= train["num_tokens"] < 3000 + longest and 300 <= val["num_tokens"] < 300 + longest
    assert train["num_documents"] < 540  # it stopped early
    # Stream order is shard order: shard 0 holds texts[0::3]; every 10th document is held out for val.
    def first_document(store):
        return streamed.tokenizer.decode(store.tokens[: int(store.doc_starts[1]) - 1].tolist())
    assert first_document(streamed.train.store) == texts[0] and first_document(streamed.val.store) == texts[27]


@pytest.mark.slow
def test_broken_cache_is_rebuilt_not_reused(tmp_path, capsys):
    cfg = stdlib_cfg(tmp_path)
    good = blocks(build_data(cfg, 32, seed=0).train)
    folder = next((tmp_path / "stores").glob("*-train"))
    tokens = folder / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:1000])  # as if a copy were cut short
    killed = folder.with_name(folder.name + ".tmp4242")  # a killed preparation's leftovers
    killed.mkdir()
    (killed / "tokens.bin").write_bytes(b"\0" * 10)
    again = build_data(cfg, 32, seed=0)
    out = capsys.readouterr().out
    assert "rebuilding the train token store" in out and "tokens.bin has 1000 bytes" in out
    assert torch.equal(blocks(again.train), good) and not killed.exists()


def test_a_second_process_waits_for_the_store_being_built(tmp_path):
    """The jobs of a sweep start together on a cold cache: one builds the stores under the key's lock,
    the others wait and open them (a waiting job once removed the builder's temp folder as a killed
    one's leftover, failing the builder)."""
    import shutil
    import threading
    import time

    from filelock import FileLock

    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(50)))
    cfg = local_cfg(tmp_path / "d.jsonl", tmp_path)
    good = blocks(build_data(cfg, 16, seed=0).train)
    (lock,) = (tmp_path / "stores").glob("*.lock")
    for folder in (tmp_path / "stores").glob("*-*"):
        shutil.rmtree(folder)
    built = {}
    with FileLock(lock):  # another process is building
        waiting = threading.Thread(target=lambda: built.update(data=build_data(cfg, 16, seed=0)))
        waiting.start()
        time.sleep(1.0)
        assert waiting.is_alive() and not list((tmp_path / "stores").glob("*-*"))
    waiting.join()
    assert torch.equal(blocks(built["data"].train), good)


def test_sampler_is_an_epoch_permutation_keyed_by_seed():
    for n in (1, 7, 64, 1000, 4097):
        assert sorted(permute(np.arange(n), n, key=3).tolist()) == list(range(n))
    epoch = torch.cat([global_batch(s, 1000, 10, seed=0) for s in range(100)])
    assert sorted(epoch.tolist()) == list(range(1000))  # every block once per epoch
    assert not torch.equal(global_batch(0, 1000, 10, 0), global_batch(100, 1000, 10, 0))  # a new order per epoch
    assert not torch.equal(global_batch(0, 1000, 10, 0), global_batch(0, 1000, 10, 1))  # and per seed
    assert torch.equal(global_batch(5, 10**9, 8, 0), global_batch(5, 10**9, 8, 0))


def test_data_errors(tmp_path, monkeypatch):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    cfg = local_cfg(tmp_path / "d.jsonl", tmp_path)
    with pytest.raises(ValueError, match="has no text column 'text'; its columns: body"):
        build_data(cfg, 16, 0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_data(OmegaConf.merge(cfg, {"path": str(tmp_path / "missing.txt")}), 16, 0)
    with pytest.raises(ValueError, match="unknown data 'nope'; valid: "):
        build_data(OmegaConf.merge(cfg, {"name": "nope"}), 16, 0)
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.jsonl").write_text(json.dumps({"text": "some text " * 50}) + "\n")
    (tmp_path / "shards" / "b.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"b.jsonl is empty"):
        build_data(local_cfg(tmp_path / "shards", tmp_path), 16, 0)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"^data.path='no-such-org/no-such-dataset': cannot load it \(") as e:
        build_data(hf_cfg("no-such-org/no-such-dataset", tmp_path), 16, 0)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="data.streaming=true needs data.max_tokens"):
        (tmp_path / "hub").mkdir()
        (tmp_path / "hub" / "train.jsonl").write_text(json.dumps({"text": "x y z"}) + "\n")
        build_data(hf_cfg(tmp_path / "hub", tmp_path, streaming=True), 16, 0)
