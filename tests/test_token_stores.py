"""data.tokenizer as a local transformers tokenizer instead of the BPE, with a vocabulary over 65,536:
the token store is uint32 and holds every id as the tokenizer gave it."""
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

pytestmark = pytest.mark.usefixtures("one_thread")

EOS, UNK, WORDS = "<|endoftext|>", "[UNK]", 70_000


def word_level_tokenizer(folder):
    """A word-level tokenizer of WORDS + 2 ids ("w0" ... "w69999", EOS, UNK), saved as a transformers
    tokenizer dir (built here: no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS: 0, UNK: 1, **{f"w{i}": i + 2 for i in range(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token=UNK).save_pretrained(folder)
    return vocab


def test_hf_tokenizer_path_and_uint32_store(tmp_path):
    from data import build_data

    vocab = word_level_tokenizer(tmp_path / "tokenizer")
    rng = np.random.default_rng(0)
    docs = [" ".join(f"w{i}" for i in rng.choice([*range(10), *range(65_530, WORDS)], size=60)) for _ in range(10)]
    (tmp_path / "corpus").mkdir()
    for n, text in enumerate(docs):
        (tmp_path / "corpus" / f"doc{n}.txt").write_text(text)
    cfg = OmegaConf.create({"name": "local", "path": str(tmp_path / "corpus"), "text_column": "text", "max_documents": None,
                            "val_fraction": 0.2, "tokenizer": str(tmp_path / "tokenizer"), "vocab_size": 512,
                            "cache_dir": str(tmp_path / "cache"), "document_mask": True, "num_proc": 1})
    data = build_data(cfg, 16, seed=0)

    assert data.vocab_size == len(data.tokenizer) == WORDS + 2 and data.tokenizer.get_vocab() == vocab
    assert not (tmp_path / "cache" / "tokenizers").exists()  # no BPE was trained
    ids = [[vocab[w] for w in doc.split()] + [vocab[EOS]] for doc in docs]
    expected = {"train": [i for n, doc in enumerate(ids) if n % 5 != 4 for i in doc],  # every 5th document: val
                "val": [i for n, doc in enumerate(ids) if n % 5 == 4 for i in doc]}
    for split in ("train", "val"):
        store = getattr(data, split).store
        assert store.meta["dtype"] == "uint32" and (store.folder / "tokens.bin").stat().st_size == 4 * len(store)
        assert store.tokens.tolist() == expected[split]
    assert max(expected["train"]) > 65_535
    block = data.train.batch(torch.arange(2))["input_ids"]  # what the model is fed: int64, ids as stored
    assert block.flatten().tolist() == expected["train"][:32]
