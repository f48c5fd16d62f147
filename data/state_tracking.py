"""State tracking as `data=state_tracking`: the word problem of a finite group, the running product of a stream
of group elements labelled at every position (Merrill et al. 2024, "The Illusion of State in State-Space
Models"; Grazzi et al. 2025, "Unlocking State-Tracking in Linear RNNs Through Negative Eigenvalues").

Tasks (data.task): a group G whose elements are the token ids 0 .. |G|-1, id 0 its identity:
    parity      Z_2: bits, the state their running XOR
    mod_count   Z_m, m = data.modulus: integers mod m, the state their running sum mod m
    s3, s4, a5, s5  permutations of {0, .., n-1} in one-line notation (s[i] = the image of i), numbered in
                itertools.permutations' (lexicographic) order; A5 keeps the even ones. |S3| = 6, |S4| = 24,
                |A5| = 60, |S5| = 120 (DeltaProduct's four word problems, Siems et al. 2025).
An example x_0 x_1 ... (each uniform over G) has the state p_t = x_0 . x_1 . ... . x_t, where
(s . u)(i) = u(s(i)): permutations act left to right, x_0 first (sympy's Permutation product).
Labels are ids of the same vocabulary (vocab_size = |G|), aligned with input_ids and shifted by the model,
as MQAR's: labels[t + 1] = p_t is predicted at position t from x_0 .. x_t; labels[0] = -100.

Lengths: T = trainer.seq_len. A training block of T elements labels p_0 .. p_{T-2} (p_{T-1}'s slot would be
past the block). The model is causal and every position is labelled, so each prefix of a block is a training
sequence of its own length: a block holds every length 1 .. T-1 at once (separate sequences of lengths up to T,
as Grazzi et al. train on up to 40, are the same prefixes, weighted toward the short ones).

Evaluation (`extra_eval`): test sequences of 8T elements; the greedy accuracy at position t against p_t over
the positions [kT/2, kT) (prefix lengths (kT/2, kT]) for k in EVAL_FACTORS = 1, 2, 4, 8, logged as
"val/state_acc/<kT>" (the 1x band is the second half of the training length, the others lie past it), and
their unweighted mean "val/state_acc". The val split (val/loss) is the test sequences' first T elements.

Deterministic: split `train`/`test` uses numpy PCG64 seeded by (seed, split).
"""
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from common.validation import Problems, Rule, positive
from data.registry import DATASETS
from data.types import Data, Split

TASKS = ("parity", "mod_count", "s3", "s4", "a5", "s5")
EVAL_FACTORS = (1, 2, 4, 8)
SPLITS = {"train": 0, "test": 1}


@dataclass(frozen=True)
class Group:
    elements: list       # what each token id stands for: an integer mod m, or a permutation in one-line notation
    table: np.ndarray    # [|G|, |G|] int64, table[a, b] = the id of a . b

    def __len__(self) -> int:
        return len(self.elements)


def cyclic_group(m: int) -> Group:
    """Z_m: a . b = (a + b) mod m."""
    ids = np.arange(m)
    return Group(list(range(m)), (ids[:, None] + ids[None, :]) % m)


def is_even(perm: tuple) -> bool:
    """An even number of inversions."""
    return sum(a > b for a, b in itertools.combinations(perm, 2)) % 2 == 0


def permutation_group(n: int, even_only: bool) -> Group:
    """S_n (A_n with even_only) in lexicographic order, (s . u)[i] = u[s[i]]."""
    elements = [p for p in itertools.permutations(range(n)) if not even_only or is_even(p)]
    index = {p: i for i, p in enumerate(elements)}
    table = np.array([[index[tuple(u[i] for i in s)] for u in elements] for s in elements], dtype=np.int64)
    return Group(elements, table)


def build_group(task: str, modulus: int) -> Group:
    """The group of data.task (one of TASKS, checked with the config: RULES)."""
    return {"parity": lambda: cyclic_group(2), "mod_count": lambda: cyclic_group(modulus),
            "s3": lambda: permutation_group(3, False), "s4": lambda: permutation_group(4, False),
            "a5": lambda: permutation_group(5, True),
            "s5": lambda: permutation_group(5, False)}[task]()


def running_products(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """p[:, t] = ids[:, 0] . ids[:, 1] . ... . ids[:, t] (p_t = p_{t-1} . x_t), [N, L] int64."""
    products = np.empty_like(ids)
    products[:, 0] = ids[:, 0]
    for t in range(1, ids.shape[1]):
        products[:, t] = table[products[:, t - 1], ids[:, t]]
    return products


def word_problems(group: Group, num_examples: int, length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """input_ids (uniform over G) and their running products, [num_examples, length] int64."""
    ids = rng.integers(0, len(group), size=(num_examples, length))
    return ids, running_products(group.table, ids)


def labelled(ids: np.ndarray, products: np.ndarray) -> Split:
    """The Split whose labels put p_t at t + 1 (the model shifts them)."""
    labels = np.full_like(ids, -100)
    labels[:, 1:] = products[:, :-1]
    return Split(torch.from_numpy(ids), torch.from_numpy(labels))


def eval_length(seq_len: int) -> int:
    """The test sequences' length: the longest band's end."""
    return max(EVAL_FACTORS) * seq_len


# its keys in a train.py or eval.py config (common/validation.py; data/options.py holds the other data.* keys)
RULES = {
    "data.task": Rule(str, choices=TASKS),
    "data.modulus": Rule(int, at_least=2),
    "data.train_examples": positive(),
    "data.test_examples": positive(),
}


def cross_checks(config: dict, problems: Problems) -> None:
    """With data=state_tracking, the model's positions reach the longest test sequence (eval_length)."""
    if (config["data"]["name"] != "state_tracking"
            or not problems.fine("trainer.seq_len", "model.max_position_embeddings")):
        return
    seq_len, positions = config["trainer"]["seq_len"], config["model"]["max_position_embeddings"]
    if (longest := eval_length(seq_len)) > positions:
        factor = longest // seq_len
        problems.add(f"trainer.seq_len={seq_len}; valid with data=state_tracking (tested at {factor} x "
                     f"trainer.seq_len = {longest} tokens): <= model.max_position_embeddings / {factor} = "
                     f"{positions // factor}")


def band_metrics(correct_per_position: torch.Tensor, seq_len: int) -> dict:
    """val/state_acc/<kT>: the mean of a [eval_length] accuracy over positions [kT/2, kT); val/state_acc their mean."""
    out = {f"val/state_acc/{k * seq_len}": correct_per_position[k * seq_len // 2:k * seq_len].mean().item()
           for k in EVAL_FACTORS}
    out["val/state_acc"] = sum(out.values()) / len(out)
    return out


@torch.no_grad()
def state_accuracy(model, ids: torch.Tensor, products: torch.Tensor, seq_len: int, device, batch_size: int = 64) -> dict:
    """Greedy accuracy of the argmax at each position t against p_t, by length band (band_metrics)."""
    was_training = model.training
    model.eval()
    correct = torch.zeros(ids.shape[1], dtype=torch.float64)
    for rows in torch.arange(len(ids)).split(batch_size):
        predicted = model(input_ids=ids[rows].to(device)).logits.argmax(-1).cpu()
        correct += (predicted == products[rows]).sum(0)
    model.train(was_training)
    return band_metrics(correct / len(ids), seq_len)


@DATASETS.register("state_tracking")
def build_state_tracking(cfg, seq_len: int, seed: int) -> Data:
    group = build_group(cfg.task, cfg.modulus)
    rng = lambda split: np.random.Generator(np.random.PCG64([seed, SPLITS[split]]))
    train = labelled(*word_problems(group, cfg.train_examples, seq_len, rng("train")))
    test_ids, test_products = word_problems(group, cfg.test_examples, eval_length(seq_len), rng("test"))
    val = labelled(test_ids[:, :seq_len], test_products[:, :seq_len])
    test_ids, test_products = torch.from_numpy(test_ids), torch.from_numpy(test_products)
    return Data(
        train=train, val=val, vocab_size=len(group),
        extra_eval=lambda model, device: state_accuracy(model, test_ids, test_products, seq_len, device),
        info={"task": cfg.task, "group_order": len(group), "train_examples": len(train),
              "test_examples": len(test_ids), "bands": [k * seq_len for k in EVAL_FACTORS]},
    )
