"""State-tracking data (data/state_tracking.py): the groups against sympy's, the labels against running products
computed independently (sympy's permutation product, numpy's cumulative sum), the length bands of its accuracy,
determinism, and a tiny training run that logs the band metrics."""
import itertools

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from sympy.combinatorics import Permutation
from sympy.combinatorics.named_groups import AlternatingGroup, SymmetricGroup

from data.state_tracking import TASKS, band_metrics, build_group, build_state_tracking, state_accuracy
from model import MIXERS

ORDERS = {"parity": 2, "mod_count": 5, "s3": 6, "s4": 24, "a5": 60, "s5": 120}


def st_cfg(task="parity", modulus=5, train=32, test=8):
    return OmegaConf.create({"name": "state_tracking", "task": task, "modulus": modulus, "train_examples": train,
                             "test_examples": test})


@pytest.mark.parametrize("task", TASKS)
def test_each_group_is_a_group_of_its_order(task):
    """Closed, identity at id 0, every element invertible (each row and column of the table a permutation of the
    ids), associative, of the order the task names."""
    g = build_group(task, 5)
    n = len(g)
    assert n == ORDERS[task] and g.table.shape == (n, n)
    ids = np.arange(n)
    assert (np.sort(g.table, axis=0) == ids[:, None]).all() and (np.sort(g.table, axis=1) == ids[None, :]).all()
    assert (g.table[0] == ids).all() and (g.table[:, 0] == ids).all()
    t = g.table
    assert (t[t[:, :, None], ids[None, None, :]] == t[ids[:, None, None], t[None, :, :]]).all()  # (ab)c = a(bc)


def test_mod_count_follows_the_modulus():
    g = build_group("mod_count", 7)
    assert len(g) == 7 and g.table[3, 6] == 2


@pytest.mark.parametrize("task,n,reference", [("s3", 3, SymmetricGroup(3)), ("s4", 4, SymmetricGroup(4)),
                                             ("a5", 5, AlternatingGroup(5)), ("s5", 5, SymmetricGroup(5))])
def test_permutation_groups_are_sympys_in_lexicographic_order(task, n, reference):
    """The elements are exactly sympy's group (A5: the 60 even permutations), numbered in lexicographic order from
    the identity; the table is sympy's product, (s * u)(i) = u(s(i))."""
    g = build_group(task, 5)
    assert sorted(g.elements) == g.elements and g.elements[0] == tuple(range(n))
    assert set(g.elements) == {tuple(p.array_form) for p in reference.generate()}
    assert all(Permutation(p).is_even for p in g.elements) == (task == "a5")
    assert len(set(itertools.permutations(range(n))) - set(g.elements)) == (60 if task == "a5" else 0)
    for a, b in [(1, 2), (2, 1), (3, len(g) - 1), (len(g) - 1, 4)]:
        assert g.elements[g.table[a, b]] == tuple((Permutation(g.elements[a]) * Permutation(g.elements[b])).array_form)


def reference_products(task: str, modulus: int, ids: np.ndarray) -> np.ndarray:
    """The running product of each row, computed without the module's table: cumulative sums for Z_m, sympy's
    Permutation product applied element by element for the permutation groups."""
    if task in ("parity", "mod_count"):
        return np.cumsum(ids, axis=1) % (2 if task == "parity" else modulus)
    elements = build_group(task, modulus).elements
    index = {p: i for i, p in enumerate(elements)}
    out = np.empty_like(ids)
    for r, row in enumerate(ids):
        state = Permutation(list(elements[row[0]]))
        out[r, 0] = row[0]
        for t in range(1, len(row)):
            state = state * Permutation(list(elements[row[t]]))
            out[r, t] = index[tuple(state.array_form)]
    return out


@pytest.mark.parametrize("task", TASKS)
def test_labels_are_the_running_product(task):
    """Train and val labels: labels[t + 1] = x_0 . ... . x_t, labels[0] ignored; the inputs cover the group."""
    data = build_state_tracking(st_cfg(task, modulus=5, train=64, test=4), 24, seed=1)
    assert data.vocab_size == ORDERS[task] and data.tokenizer is None
    for split in (data.train, data.val):
        ids = split.input_ids.numpy()
        assert ids.shape[1] == 24 and (split.labels[:, 0] == -100).all()
        assert (split.labels[:, 1:].numpy() == reference_products(task, 5, ids)[:, :-1]).all()
    assert len(np.unique(data.train.input_ids)) == ORDERS[task]


def test_mod_count_labels_follow_the_modulus():
    data = build_state_tracking(st_cfg("mod_count", modulus=3, train=8, test=2), 20, seed=0)
    ids = data.train.input_ids.numpy()
    assert data.vocab_size == 3 and (data.train.labels[:, 1:].numpy() == np.cumsum(ids, 1)[:, :-1] % 3).all()


def test_deterministic_by_seed():
    cfg = st_cfg("s3")
    a, b, c = build_state_tracking(cfg, 16, 0), build_state_tracking(cfg, 16, 0), build_state_tracking(cfg, 16, 1)
    assert torch.equal(a.train.input_ids, b.train.input_ids) and torch.equal(a.val.labels, b.val.labels)
    assert not torch.equal(a.train.input_ids, c.train.input_ids)
    assert not torch.equal(a.train.input_ids[:8], a.val.input_ids)  # the test set is not the train set


class ParityOracle(torch.nn.Module):
    """Logits that put the running parity first at the positions before `right_until` and the wrong bit after."""

    def __init__(self, right_until: int):
        super().__init__()
        self.right_until, self.calls = right_until, []

    def forward(self, input_ids):
        self.calls.append(tuple(input_ids.shape))
        parity = input_ids.cumsum(1) % 2
        parity[:, self.right_until:] = 1 - parity[:, self.right_until:]
        return type("Out", (), {"logits": torch.nn.functional.one_hot(parity, 2).float()})()


def test_accuracy_bands_are_positions_half_to_one_times_each_length():
    """T = 8: test sequences of 64; band k covers positions [4k, 8k). Right before position 10: band 8 all right,
    band 16 has 2 of its 8 positions right, the longer bands none."""
    data = build_state_tracking(st_cfg("parity", test=6), 8, seed=0)
    assert data.info["bands"] == [8, 16, 32, 64]
    oracle = ParityOracle(right_until=10)
    acc = data.extra_eval(oracle, "cpu")
    assert oracle.calls == [(6, 64)]  # every test sequence, at 8 x T
    assert acc == {"val/state_acc/8": 1.0, "val/state_acc/16": 0.25, "val/state_acc/32": 0.0, "val/state_acc/64": 0.0,
                   "val/state_acc": 1.25 / 4}
    assert data.extra_eval(ParityOracle(right_until=64), "cpu")["val/state_acc"] == 1.0


def test_band_metrics_average_positions_within_each_band():
    correct = torch.arange(24, dtype=torch.float64) / 24  # T = 3: bands [1, 3), [3, 6), [6, 12), [12, 24)
    acc = band_metrics(correct, 3)
    assert acc["val/state_acc/3"] == pytest.approx(1.5 / 24) and acc["val/state_acc/6"] == pytest.approx(4 / 24)
    assert acc["val/state_acc/12"] == pytest.approx(8.5 / 24) and acc["val/state_acc/24"] == pytest.approx(17.5 / 24)


@pytest.mark.parametrize("mixer", MIXERS.names())
def test_state_accuracy_of_a_model_counts_argmax_hits(mixer, one_thread):
    """A DecoderLM of each mixer at 8x its training length: state_accuracy's count equals the hits of its argmax
    computed here, by band."""
    from model import DecoderLM, LMConfig

    torch.manual_seed(0)
    model = DecoderLM(LMConfig(vocab_size=6, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=48, mixer=mixer))
    ids = torch.randint(0, 6, (5, 48), generator=torch.Generator().manual_seed(3))
    products = torch.from_numpy(reference_products("s3", 5, ids.numpy()))
    with torch.no_grad():
        hits = (model(input_ids=ids).logits.argmax(-1) == products).double().mean(0)
    acc = state_accuracy(model, ids, products, 6, "cpu", batch_size=2)
    assert 0 < acc["val/state_acc"] < 1
    for k, (lo, hi) in zip((6, 12, 24, 48), ((3, 6), (6, 12), (12, 24), (24, 48))):
        assert acc[f"val/state_acc/{k}"] == pytest.approx(hits[lo:hi].mean().item())
    assert model.training  # put back as found


@pytest.mark.parametrize("overrides,message", [
    (["data.task=d4"], "data.task='d4'; valid: one of parity, mod_count, s3, s4, a5, s5"),
    (["data.modulus=1"], "data.modulus=1; valid: an integer >= 2"),
    (["trainer.seq_len=600"], "trainer.seq_len=600; valid with data=state_tracking (tested at 8 x trainer.seq_len = "
                              "4800 tokens): <= model.max_position_embeddings / 8 = 512"),
])
def test_bad_options_are_one_line(overrides, message):
    from runs.config import compose
    from training.validation import check_train_config

    with pytest.raises(ValueError) as e:
        check_train_config(compose(["experiment=state_tracking", *overrides]))
    assert str(e.value) == message


@pytest.mark.slow
def test_a_tiny_run_logs_the_bands(tmp_path):
    """experiment=state_tracking on S3 with gdn, 4 steps at T = 16: every evaluation logs val/state_acc/<16, 32, 64,
    128> and their mean to metrics.jsonl, the numbers the exported model scores on the same test sequences, and the
    run draws state_acc.png."""
    from conftest import train_here
    from data import build_data
    from runs.checkpoint import load_lm
    from runs.metrics import read_metrics

    out = train_here(tmp_path, "experiment=state_tracking", "data.task=s3", "mixer=gdn", "model.hidden_size=32",
                     "data.train_examples=64", "data.test_examples=4", "trainer.seq_len=16", "trainer.batch_size=8",
                     "trainer.max_steps=4", "trainer.warmup_steps=1", "trainer.eval_every=2", "trainer.log_every=2",
                     base=["logger=none"])
    names = ["val/state_acc/16", "val/state_acc/32", "val/state_acc/64", "val/state_acc/128"]
    evals = [r for r in read_metrics(tmp_path) if "val/state_acc" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for row in evals:
        assert row["val/state_acc"] == pytest.approx(sum(row[n] for n in names) / 4)
    cfg = OmegaConf.load(tmp_path / "config.yaml")
    rescored = build_data(cfg.data, 16, cfg.seed).extra_eval(load_lm(tmp_path / "final"), "cpu")
    assert rescored == pytest.approx({n: evals[-1][n] for n in [*names, "val/state_acc"]})
    assert "val/state_acc/128" in out and (tmp_path / "state_acc.png").stat().st_size > 0


def test_deltaproduct_protocol_builds_its_model():
    """The command in configs/experiment/state_tracking_deltaproduct.yaml's header, as written there, builds
    DeltaProduct's state-tracking model and protocol (its repository's state_tracking/src/main.py): one layer of d 128,
    8 heads of 32, expand_v 1, FFN 512, no short convs, decay or output gate; T 128; AdamW (0.9, 0.999), weight
    decay 1e-6, lr 1e-3 on a cosine to 0 without warm-up."""
    import shlex

    from conftest import ROOT
    from runs.config import compose, meta_model
    from training.validation import check_train_config

    header = [line[1:].strip() for line in (ROOT / "configs/experiment/state_tracking_deltaproduct.yaml").read_text()
              .splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(header) if line.startswith("python train.py "))
    end = next(i for i in range(start, len(header)) if not header[i].endswith("\\"))
    overrides = shlex.split(" ".join(line.rstrip("\\") for line in header[start:end + 1]))[2:]
    cfg = compose(overrides)
    check_train_config(cfg)
    lm = meta_model(cfg)
    mixer = lm.layers[0].mixer
    assert len(lm.layers) == 1 and lm.config.hidden_size == 128 and lm.config.intermediate_size == 512
    assert (mixer.steps, mixer.allow_neg_eigval, mixer.num_heads, mixer.head_dim, mixer.head_v_dim) == (2, True, 8, 32, 32)
    assert {n.split(".")[0] for n, _ in mixer.named_parameters()} == {"q_proj", "k_proj", "v_proj", "b_proj", "o_proj",
                                                                     "o_norm"}
    t, o = cfg.trainer, cfg.optimizer
    assert (t.seq_len, t.lr, t.schedule, t.min_lr_ratio, t.warmup_steps) == (128, 1e-3, "cosine", 0.0, 0)
    assert (o.name, list(o.betas), o.weight_decay) == ("adamw", [0.9, 0.999], 1e-6)
