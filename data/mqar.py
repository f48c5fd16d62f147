"""Multi-query associative recall (MQAR), the zoology protocol (Arora et al. 2023), as `data=mqar`.

One example of a slice (seq_len S, num_kv_pairs n), vocabulary V:
    positions 0 .. 2n-1:  k_1 v_1 k_2 v_2 ... k_n v_n      n distinct keys from [1, V/2), n distinct
                                                          values from [V/2, V)
    positions 2n .. S-1:  S' = (S - 2n) // 2 query slots at 2n + 2g, g in 0..S'-1; n of them are drawn
                          without replacement with P(g) ~ a (g+1)^(a-1), a = power_a (queries cluster
                          early); slot g holds key k_i and the position after it has label v_i
    every other position: a random token from [0, V) (zoology's filler), label -100.
Labels are aligned with input_ids (the model shifts them): labels[q + 1] = v_i is predicted at the
query position q, and input_ids[q + 1] is filler, as in zoology.

Slices of different lengths share one block length T = trainer.seq_len >= every slice's S: a slice is
generated at its own S and then right-padded to T with filler labelled -100. A causal model's
predictions at positions < S do not see the padding, so this equals training at length S.

Deterministic: slice i of split `train`/`test` uses numpy PCG64 seeded by (seed, split, i). The val
split is the test set (val loss = loss on query labels); `extra_eval` adds the accuracy on query
labels per slice ("val/mqar_acc/<S>x<n>") and their unweighted mean over slices ("val/mqar_acc").
"""
import numpy as np
import torch

from data.registry import DATASETS
from data.types import Data, Split

SPLITS = {"train": 0, "test": 1}


def mqar_slice(num_examples: int, seq_len: int, num_kv_pairs: int, vocab_size: int, power_a: float,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """input_ids, labels: [num_examples, seq_len] int64, one slice of the protocol above."""
    context = 2 * num_kv_pairs
    slots = (seq_len - context) // 2
    half = vocab_size // 2
    if num_kv_pairs < 1 or num_kv_pairs > half - 1 or slots < num_kv_pairs:
        raise ValueError(f"mqar slice seq_len={seq_len} num_kv_pairs={num_kv_pairs} vocab_size={vocab_size}: need "
                         f"1 <= num_kv_pairs < vocab_size/2 and seq_len >= 4 * num_kv_pairs")
    keys = np.stack([rng.choice(np.arange(1, half), num_kv_pairs, replace=False) for _ in range(num_examples)])
    values = np.stack([rng.choice(np.arange(half, vocab_size), num_kv_pairs, replace=False) for _ in range(num_examples)])
    p = power_a * np.arange(1, slots + 1, dtype=np.float64) ** (power_a - 1)
    p /= p.sum()
    gaps = np.stack([rng.choice(slots, num_kv_pairs, replace=False, p=p) for _ in range(num_examples)])
    ids = rng.integers(0, vocab_size, size=(num_examples, seq_len))  # filler everywhere, then overwrite
    ids[:, 0:context:2], ids[:, 1:context:2] = keys, values
    queries = context + 2 * gaps  # query i asks for key i (pairs keep their context order)
    np.put_along_axis(ids, queries, keys, axis=1)
    labels = np.full((num_examples, seq_len), -100, dtype=np.int64)
    np.put_along_axis(labels, queries + 1, values, axis=1)
    return ids.astype(np.int64), labels


def build_split(cfg, which: str, seq_len: int, seed: int) -> tuple[Split, list[tuple[str, slice]]]:
    """All slices of `which`, padded to seq_len; also (name, row range) per slice."""
    ids, labels, ranges, start = [], [], [], 0
    for i, s in enumerate(cfg[which]):
        if s.seq_len > seq_len:
            raise ValueError(f"data.{which}[{i}].seq_len={s.seq_len} exceeds trainer.seq_len={seq_len}")
        rng = np.random.Generator(np.random.PCG64([seed, SPLITS[which], i]))
        x, y = mqar_slice(s.num_examples, s.seq_len, s.num_kv_pairs, cfg.vocab_size, cfg.power_a, rng)
        pad = seq_len - s.seq_len
        ids.append(np.concatenate([x, rng.integers(0, cfg.vocab_size, size=(len(x), pad))], 1))
        labels.append(np.pad(y, ((0, 0), (0, pad)), constant_values=-100))
        ranges.append((f"{s.seq_len}x{s.num_kv_pairs}", slice(start, start + len(x))))
        start += len(x)
    return Split(torch.from_numpy(np.concatenate(ids)), torch.from_numpy(np.concatenate(labels))), ranges


@torch.no_grad()
def query_accuracy(model, split: Split, ranges: list[tuple[str, slice]], device, batch_size: int = 64) -> dict:
    """Greedy accuracy on the query labels (argmax at q predicts labels[q + 1]), per slice and their mean."""
    was_training = model.training
    model.eval()
    out = {}
    for name, rows in ranges:
        correct = total = 0
        for idx in torch.arange(rows.start, rows.stop).split(batch_size):
            batch = split.batch(idx)
            logits = model(input_ids=batch["input_ids"].to(device)).logits[:, :-1]
            target = batch["labels"][:, 1:].to(device)
            mask = target != -100
            correct += (logits.argmax(-1)[mask] == target[mask]).sum().item()
            total += mask.sum().item()
        out[f"val/mqar_acc/{name}"] = correct / total
    model.train(was_training)
    out["val/mqar_acc"] = sum(out.values()) / len(out)
    return out


@DATASETS.register("mqar")
def build_mqar(cfg, seq_len: int, seed: int) -> Data:
    if cfg.vocab_size < 4:
        raise ValueError(f"data.vocab_size={cfg.vocab_size} is too small for MQAR; need >= 4")
    train, _ = build_split(cfg, "train", seq_len, seed)
    test, ranges = build_split(cfg, "test", seq_len, seed)
    return Data(
        train=train, val=test, vocab_size=cfg.vocab_size,
        extra_eval=lambda model, device: query_accuracy(model, test, ranges, device),
        info={"train_examples": len(train), "test_examples": len(test), "slices": [n for n, _ in ranges]},
    )
