"""MQAR data (data/mqar.py) against the zoology protocol, its accuracy metric, and a softmax model
learning a tiny instance."""
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from data.mqar import build_mqar, mqar_slice, query_accuracy


def mqar_cfg(vocab=64, train=((32, 4, 64),), test=((32, 4, 16),)):
    rows = lambda slices: [{"seq_len": s, "num_kv_pairs": n, "num_examples": e} for s, n, e in slices]
    return OmegaConf.create({"name": "mqar", "vocab_size": vocab, "power_a": 0.01, "train": rows(train), "test": rows(test)})


def check_example(ids, labels, seq_len, n, vocab):
    """Every protocol rule, checked on one example; returns the query slots."""
    half, context = vocab // 2, 2 * n
    keys, values = ids[0:context:2].tolist(), ids[1:context:2].tolist()
    assert len(set(keys)) == n and all(1 <= k < half for k in keys)
    assert len(set(values)) == n and all(half <= v < vocab for v in values)
    pair = dict(zip(keys, values))
    assert (labels[:context + 1] == -100).all()  # nothing to predict inside the context
    assert (labels[seq_len:] == -100).all()  # padding beyond the slice's length
    targets = (labels != -100).nonzero().flatten().tolist()
    assert len(targets) == n
    slots, asked = [], []
    for p in targets:
        q = p - 1  # the query position: its next-token label is the value
        assert q >= context and (q - context) % 2 == 0 and p < seq_len
        assert labels[p].item() == pair[ids[q].item()]
        asked.append(ids[q].item())
        slots.append((q - context) // 2)
    assert sorted(asked) == sorted(keys)  # every key asked exactly once
    assert ((ids >= 0) & (ids < vocab)).all()
    return slots


def test_slices_follow_the_protocol():
    cfg = mqar_cfg(vocab=64, train=((32, 4, 50), (48, 8, 50)), test=((32, 4, 20), (48, 8, 20), (48, 12, 20)))
    data = build_mqar(cfg, 48, seed=3)
    assert data.vocab_size == 64 and data.tokenizer is None and data.bytes_per_token is None
    assert data.train.input_ids.shape == data.train.labels.shape == (100, 48)
    assert data.val.input_ids.shape == (60, 48) and data.info["slices"] == ["32x4", "48x8", "48x12"]
    for split, slices in ((data.train, [(32, 4)] * 50 + [(48, 8)] * 50),
                          (data.val, [(32, 4)] * 20 + [(48, 8)] * 20 + [(48, 12)] * 20)):
        for row, (seq_len, n) in enumerate(slices):
            check_example(split.input_ids[row], split.labels[row], seq_len, n, 64)
    # Filler: random tokens, not a constant (zoology's random non-query tokens).
    assert data.train.input_ids[:, 40:].unique().numel() > 30


def test_queries_cluster_early_with_power_law():
    """P(slot g) ~ a (g+1)^(a-1), a = 0.01: the first slot alone is drawn far more often than the last."""
    ids, labels = mqar_slice(2000, 64, 2, 64, 0.01, np.random.Generator(np.random.PCG64(0)))
    slots = np.concatenate([check_example(torch.from_numpy(i), torch.from_numpy(l), 64, 2, 64) for i, l in zip(ids, labels)])
    counts = np.bincount(slots, minlength=30)
    p = 0.01 * np.arange(1, 31) ** (0.01 - 1)
    p /= p.sum()
    # Drawing 2 without replacement: P(slot 0 in the sample) = p0 + sum_{j != 0} p_j p0 / (1 - p_j).
    expected0 = p[0] + sum(p[j] * p[0] / (1 - p[j]) for j in range(1, 30))
    assert counts[0] / 2000 == pytest.approx(expected0, abs=0.04)
    assert counts[:5].sum() > 2.5 * counts[-5:].sum()


def test_deterministic_by_seed_and_split():
    cfg = mqar_cfg()
    a, b, c = build_mqar(cfg, 32, 0), build_mqar(cfg, 32, 0), build_mqar(cfg, 32, 1)
    assert torch.equal(a.train.input_ids, b.train.input_ids) and torch.equal(a.val.labels, b.val.labels)
    assert not torch.equal(a.train.input_ids, c.train.input_ids)
    assert not torch.equal(a.train.input_ids[:16], a.val.input_ids)  # test set is not the train set


@pytest.mark.parametrize("cfg,seq_len,needle", [
    (mqar_cfg(train=((64, 4, 8),)), 32, "data.train[0].seq_len=64 exceeds trainer.seq_len=32"),
    (mqar_cfg(train=((16, 8, 8),)), 32, "need 1 <= num_kv_pairs"),
    (mqar_cfg(vocab=8, train=((32, 4, 8),)), 32, "num_kv_pairs=4 vocab_size=8"),
])
def test_bad_slices_fail_with_clear_message(cfg, seq_len, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        build_mqar(cfg, seq_len, 0)


class Oracle(torch.nn.Module):
    """Logits that put the labels' values first at query positions (wrong on half the rows if `half`)."""

    def __init__(self, split, vocab, half=False):
        super().__init__()
        self.split, self.vocab, self.half = split, vocab, half

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        for b, ids in enumerate(input_ids):
            row = next(i for i in range(len(self.split)) if torch.equal(self.split.input_ids[i], ids))
            target = self.split.labels[row, 1:]
            for t in (target != -100).nonzero().flatten():
                wrong = self.half and row % 2 == 1
                logits[b, t, (target[t] + wrong) % self.vocab] = 1.0
        return type("Out", (), {"logits": logits})()


def test_accuracy_counts_query_positions_only():
    data = build_mqar(mqar_cfg(test=((32, 4, 10), (32, 2, 10))), 32, 0)
    ranges = [("32x4", slice(0, 10)), ("32x2", slice(10, 20))]
    assert query_accuracy(Oracle(data.val, 64), data.val, ranges, "cpu", 4) == {
        "val/mqar_acc/32x4": 1.0, "val/mqar_acc/32x2": 1.0, "val/mqar_acc": 1.0}
    acc = query_accuracy(Oracle(data.val, 64, half=True), data.val, ranges, "cpu", 4)
    assert acc["val/mqar_acc/32x4"] == acc["val/mqar_acc/32x2"] == acc["val/mqar_acc"] == 0.5
    assert data.extra_eval(Oracle(data.val, 64), "cpu")["val/mqar_acc"] == 1.0


@pytest.mark.slow
def test_softmax_learns_tiny_mqar():
    """2-layer softmax attention, 250 steps: recall well above the 1/num_kv_pairs = 0.5 that guessing
    one of the context's values gets (and far above 1/(V/2) uniform chance)."""
    from model import DecoderLM, LMConfig

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a d=64 model is faster on one thread, and much faster on a busy machine
    data = build_mqar(mqar_cfg(vocab=32, train=((16, 2, 4000),), test=((16, 2, 200),)), 16, 0)
    model = DecoderLM(LMConfig(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                               max_position_embeddings=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    before = data.extra_eval(model, "cpu")["val/mqar_acc"]
    for _ in range(250):
        model(**data.train.batch(torch.randint(len(data.train), (32,), generator=g))).loss.backward()
        opt.step()
        opt.zero_grad()
    after = data.extra_eval(model, "cpu")
    torch.set_num_threads(threads)
    assert before < 0.2 and after["val/mqar_acc"] > 0.75, (before, after)
    assert set(after) == {"val/mqar_acc", "val/mqar_acc/16x2"}
