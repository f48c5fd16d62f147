"""Smoke runs of the scripts behind the README's figures, at tiny sizes: studies/linearize_error.py (both
parts), studies/linearize.py, studies/dsa.py (every stage from a tiny softmax run), studies/mqar.py, and
every suite of scripts/bench.py. Each must finish and report what it promises, with the numbers that
must hold whatever the speed (speed itself is never checked here). The benchmark suites run their
--quick shapes with each timed call made once (their repeats only sharpen the timings); the data and
recipe suites on a 40-file corpus instead of the whole standard library."""
import json
import math
import re
import sys
import time

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY, ddp_launcher
from model.registry import MIXERS, ROUTERS
from scripts.bench import SUITES as BENCH_SUITES

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

TINY_MODEL = [o for o in TINY if o.startswith(("logger", "model.", "data."))]


@pytest.fixture
def softmax_run(tiny_run):
    """conftest.TINY's softmax run (its final/ export and its data config)."""
    return tiny_run[0]


def table_rows(markdown: str) -> list[list[str]]:
    """The body rows of the markdown tables in a text, as lists of cells."""
    rows = [line.strip().strip("|").split("|") for line in markdown.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row] for row in rows if not set("".join(row)) <= set("-: ")]


def test_linearize_both_parts(tmp_path, softmax_run, monkeypatch):
    """Part (a) on 1 x 64-token inputs: every error finite and growing with the logit scale; part (b) on
    the tiny softmax run, with that run itself as a "student": every core's per-layer error finite and
    above 0, the teacher's own layers exactly 0."""
    from studies import linearize_error

    make_qkv = linearize_error.make_qkv
    monkeypatch.setattr(linearize_error, "make_qkv", lambda kind: make_qkv(kind, B=1, T=64, H=2, d=16))
    monkeypatch.setattr(sys, "argv", ["linearize_error.py", "--out", str(tmp_path), "--teacher", str(softmax_run),
                                      "--students", str(softmax_run), "--sequences", "4", "--batch-size", "2"])
    linearize_error.main()
    report = (tmp_path / "report.md").read_text()
    approx, layers = report.split("## Per-layer error on the teacher's activations")
    rows = table_rows(approx)[1:]
    assert [(r[0], float(r[1])) for r in rows] == [(k, s) for k in ("random", "clustered", "drifting")
                                                   for s in linearize_error.SCALES]
    for kind in range(3):  # a first-order expansion: each method's error grows with the logit scale
        errors = torch.tensor([[float(c) for c in r[2:]] for r in rows[6 * kind: 6 * kind + 6]])
        assert torch.isfinite(errors).all() and (errors.diff(dim=0) > 0).all(), rows
    assert (tmp_path / "approximation_error.png").stat().st_size > 0
    logit_std, *rows = table_rows(layers)[1:]
    assert logit_std[0].startswith("(the teacher's attention logits") and all(0 < float(c) < 100 for c in logit_std[1:])
    assert [r[0] for r in rows] == [f"{name}, zero-shot" for name, _, _ in linearize_error.ZERO_SHOT] + ["run, trained"]
    assert all(0 < float(c) < 10 for r in rows[:-1] for c in r[1:]), rows
    assert rows[-1][1:] == ["0"] * 3, rows  # 2 layers and their mean
    assert (tmp_path / "layer_errors.png").stat().st_size > 0


def test_linearize_study(tmp_path, softmax_run, data_cache, capsys, monkeypatch, jobs_here):
    """The tiny softmax run linearized into derived GDN at two lrs (2 steps: transfer 1, distill 1) beside derived
    GDN from scratch for 2 steps: the table's row holds the teacher's val bpb gap, the zero-shot score of step 0
    (the same at both lrs: nothing trained yet), a best lr flagged as the grid's edge, and the curves plot. The
    script runs in this process as `python studies/linearize.py ...`, and its train.py jobs too (jobs_here)."""
    from studies import linearize

    overrides = [o for o in TINY_MODEL if o != "logger=none"] + ["trainer.seq_len=64", "trainer.batch_size=4",
                                                                   "trainer.warmup_steps=1", "trainer.eval_batches=2",
                                                                   "linearize.transfer_target=output"]  # q/k/v/o transfer
    monkeypatch.setenv("SWAPLM_CACHE", str(data_cache))
    monkeypatch.setattr(sys, "argv", ["studies/linearize.py", "--teacher", str(softmax_run), "--out", str(tmp_path),
                                      "--students", "derived_gdn", "--seeds", "0", "--lrs", "1e-3,3e-3", "--steps", "2",
                                      "--split", "1/1", "--teacher-tokens", "none", "--", *overrides])
    linearize.main()
    stdout = capsys.readouterr().out
    assert "running 3" in stdout and "FAILED" not in stdout, stdout[-3000:]
    (row,) = [r for r in table_rows((tmp_path / "table.md").read_text()) if r[0] == "derived_gdn"][:1]
    assert "(edge of grid)" in row[1]
    zero_shot = [json.loads(l)["val/bpb"] for lr in ("0.001", "0.003")
                 for l in (tmp_path / f"lin_derived_gdn_lr{lr}_s0" / "metrics.jsonl").read_text().splitlines()
                 if json.loads(l)["step"] == 0 and "val/bpb" in json.loads(l)]
    assert len(zero_shot) == 2 and zero_shot[0] == zero_shot[1] and row[2] == f"{zero_shot[0]:.4f}"
    assert all(math.isfinite(float(c.split()[0])) for c in row[2:8]), row
    assert (tmp_path / "curves.png").stat().st_size > 0
    # --report with a seed not run: nothing starts, and the row says how many seeds it holds
    monkeypatch.setattr(sys, "argv", ["studies/linearize.py", "--teacher", str(softmax_run), "--out", str(tmp_path),
                                      "--students", "derived_gdn", "--seeds", "0,1", "--lrs", "1e-3,3e-3", "--steps", "2",
                                      "--split", "1/1", "--report", "--", *overrides])
    linearize.main()
    stdout = capsys.readouterr().out
    assert "running" not in stdout, stdout[-3000:]
    assert not list(tmp_path.glob("*_s1*"))
    (row,) = [r for r in table_rows((tmp_path / "table.md").read_text()) if r[0] == "derived_gdn"][:1]
    assert row[5].endswith("[1 of 2 seeds]"), row


def test_linearize_study_kl_chosen_hybrid(tmp_path, softmax_run, data_cache, capsys, monkeypatch, jobs_here):
    """A hybrid whose softmax layer the KL picks (keep_softmax=auto:1), with no from-scratch runs (it has no
    from-scratch form): the table's scratch column is empty, and the layer the selection kept, read back from the
    run's exported student, is listed under the table."""
    from studies import linearize

    overrides = [o for o in TINY_MODEL if o != "logger=none"] + ["trainer.seq_len=64", "trainer.batch_size=4",
                                                                   "trainer.warmup_steps=1", "trainer.eval_batches=2"]
    monkeypatch.setenv("SWAPLM_CACHE", str(data_cache))
    monkeypatch.setattr(sys, "argv", ["studies/linearize.py", "--teacher", str(softmax_run), "--out", str(tmp_path),
                                      "--students", "hybrid_kl1", "--seeds", "0", "--lrs", "1e-3", "--steps", "2",
                                      "--split", "0/1", "--scratch-lr-factors", "none", "--teacher-tokens", "none",
                                      "--", *overrides])
    linearize.main()
    stdout = capsys.readouterr().out
    assert "running 1," in stdout and "FAILED" not in stdout, stdout[-3000:]
    assert not list(tmp_path.glob("scratch*"))
    (row,) = [r for r in table_rows((tmp_path / "table.md").read_text()) if r[0] == "hybrid_kl1"][:1]
    assert row[7] == "-" and row[8] == "-", row
    chosen = OmegaConf.load(tmp_path / "lin_hybrid_kl1_lr0.001_s0" / "config.yaml").linearize.keep_softmax
    assert len(chosen) == 1
    assert f"- hybrid_kl1: seed 0: {list(chosen)}" in (tmp_path / "table.md").read_text()


def test_dsa_study_every_stage(tmp_path, softmax_run, data_cache, monkeypatch, jobs_here):
    """From the tiny softmax run: the four train.py stages at seq_len 128 (DSA's default top-k 64 is
    below it), init_from loading every matching weight (the indexer new), and the summary: the stages
    whose attention is dense (softmax, DSA with an untrained or a warmed-up indexer) have one val loss,
    since the LM loss does not depend on the indexer there. The script runs in this process as
    `python studies/dsa.py ...`, and its train.py stages too (jobs_here), each console in <out>/<stage>.log."""
    from studies import dsa

    overrides = [*TINY_MODEL, "trainer.seq_len=128", "trainer.max_steps=2", "trainer.warmup_steps=1",
                 "trainer.eval_every=2", "trainer.ckpt_every=2", "trainer.eval_batches=1"]
    monkeypatch.setenv("SWAPLM_CACHE", str(data_cache))
    monkeypatch.setattr(sys, "argv", ["studies/dsa.py", "--softmax-run", str(softmax_run), "--out", str(tmp_path),
                                      "--", *overrides])
    dsa.main()
    stdout = "".join((tmp_path / f"{stage}.log").read_text()  # each stage's console
                     for stage in ("softmax_long_context", "dsa_untrained_indexer", "1_warmup", "2_sparse"))
    loaded = re.findall(r"init_from \S+: loaded (\d+) tensors; new: (.*?); unused: none; shape mismatch: none",
                        stdout)
    assert len(loaded) == 4 and loaded[0][1] == "none" and all(".indexer." in new for _, new in loaded[1:3])
    rows = table_rows((tmp_path / "summary.md").read_text())[1:]
    assert [r[1] for r in rows] == ["64", "128", "128", "128", "128"]
    dense = {r[2] for r in rows[1:4]}
    assert len(dense) == 1 and rows[4][2] not in dense
    assert [r[4] for r in rows[:2]] == ["-", "-"] and all(0 < float(r[4]) <= 1 for r in rows[2:])


def test_mqar_study(tmp_path, capsys, monkeypatch):
    """gdn beside transformers' Qwen3-Next GDN layers, each in its own process: both runs land in runs.jsonl
    with their curves, the table has the row and its ratio, the plots are written, and a rerun trains
    nothing. The reference ran on transformers' torch ops: fla's Triton kernels, which it binds to when fla
    is installed, raise on a CPU without the interpreter. Bad input, and linear's reference without fla,
    are one-line errors."""
    from studies import mqar

    args = ["--mixers", "gdn", "--widths", "32", "--seeds", "0", "--lrs", "1e-2", "--steps", "2", "--eval-every", "1",
            "--jobs", "2", "--out", str(tmp_path)]
    assert mqar.main(args) == 0
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert sorted(r["impl"] for r in runs) == ["ours", "qwen3_next_gdn"]
    for r in runs:
        assert [s for s, _ in r["curve"]] == [1, 2] and 0 <= r["acc"] <= 1 and set(r["slices"]) == {"64x2", "64x4", "64x8"}
    ours = next(r for r in runs if r["impl"] == "ours")
    assert ours["parametrization"] == "per_mixer" and ours["params"] > 0
    row = table_rows((tmp_path / "table.md").read_text())[1]
    assert row[:3] == ["gdn", "32", "per_mixer"] and row[4] == "qwen3_next_gdn"
    for name in ("curves.png", "mqar_state.png", "mqar_width.png"):
        assert (tmp_path / name).stat().st_size > 1000
    capsys.readouterr()
    assert mqar.main(args) == 0
    assert "2 runs, 2 already in" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown --mixers 'gnd'; valid: softmax, gdn"):
        mqar.main(["--mixers", "gnd"])
    monkeypatch.setattr(mqar.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="linear's reference is fla's .* pip install -r requirements-test.txt"):
        mqar.main(["--mixers", "linear", "--out", str(tmp_path)])


def test_mqar_study_linear_beside_fla(tmp_path):
    """linear beside fla's LinearAttention model in worker processes: fla's model calls Triton kernels (its
    linear attention, output norm and SwiGLU) that raise on a CPU without the interpreter, so the reference's
    run landing in runs.jsonl shows every one of them was swapped for torch."""
    pytest.importorskip("fla")
    from studies import mqar

    assert mqar.main(["--mixers", "linear", "--widths", "32", "--seeds", "0", "--lrs", "1e-2",
                                   "--steps", "2", "--eval-every", "1", "--jobs", "2", "--out", str(tmp_path)]) == 0
    runs = {r["impl"]: r for r in map(json.loads, (tmp_path / "runs.jsonl").read_text().splitlines())}
    assert set(runs) == {"ours", "fla_linear_attn"} and runs["fla_linear_attn"]["parametrization"] == "own"
    assert all([s for s, _ in r["curve"]] == [1, 2] and r["params"] > 0 for r in runs.values())
    row = table_rows((tmp_path / "table.md").read_text())[1]
    assert row[:3] == ["linear", "32", "per_mixer"] and row[4] == "fla_linear_attn"


@pytest.mark.slow
def test_state_tracking_study_deltaproduct_beside_fla(tmp_path):
    """deltaproduct beside fla's Gated DeltaProduct model on S3 in worker processes (fla's layer, norms and MLP call
    Triton, which raises on a CPU: the reference's run landing in runs.jsonl shows each was swapped), scored by
    train.py's length bands; the table holds both sides and flags a one-lr grid as its edge."""
    pytest.importorskip("fla")
    from studies import state_tracking

    assert state_tracking.main(["--task", "s3", "--householder", "2", "--seeds", "0", "--lrs", "1e-3", "--steps", "2",
                                "--eval-every", "1", "--jobs", "2", "--out", str(tmp_path)]) == 0
    runs = {r["impl"]: r for r in map(json.loads, (tmp_path / "runs.jsonl").read_text().splitlines())}
    assert set(runs) == {"ours", "fla_gated_deltaproduct"}
    assert runs["ours"]["params"] == runs["fla_gated_deltaproduct"]["params"]  # the same shape
    for r in runs.values():
        assert [s for s, _ in r["curve"]] == [1, 2] and [L for L, _ in r["bands"]] == [64, 128, 256, 512]
        assert all(0 <= acc <= 1 for _, acc in r["bands"])
    table = (tmp_path / "table.md").read_text()
    rows = table_rows(table)
    assert [row[:2] for row in rows[1:]] == [["s3, deltaproduct n=2 + neg", "ours"],
                                             ["s3, deltaproduct n=2 + neg", "fla_gated_deltaproduct"]]
    assert table.count("**Warning:") == 2 and (tmp_path / "state_acc_length.png").stat().st_size > 0


def test_fla_deltaproduct_reference_is_our_layer_given_our_weights(monkeypatch):
    """The state-tracking study's reference, fla's Gated DeltaProduct layer with its Triton calls swapped for torch
    (studies/side_by_side.py), computes what our deltaproduct layer computes once it holds our layer's weights, with
    and without negative eigenvalues, and in the paper's state-tracking form (no short convs, forget gate or output
    gate): so the study's two sides differ in fla's init and model body, not in the layer's math. The swaps are
    undone after the test (monkeypatch), as they patch fla's modules process-wide."""
    pytest.importorskip("fla")
    import fla.layers.gated_deltaproduct as fla_layer
    import fla.modules.mlp as fla_mlp
    from fla.modules import FusedRMSNormGated, RMSNorm, ShortConvolution

    from studies.side_by_side import Shape, ours, reference

    for owner, name in ((fla_layer, "chunk_gated_delta_product"), (fla_mlp, "swiglu"), (ShortConvolution, "forward"),
                        (FusedRMSNormGated, "forward"), (RMSNorm, "forward")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored at teardown, whatever the swap sets
    shape = Shape(layers=1, heads=2, seq_len=16)
    paper = {"num_householder": 2, "allow_neg_eigval": True, "use_short_conv": False, "use_forget_gate": False,
             "use_output_gate": False}
    for options in ({"num_householder": 3, "allow_neg_eigval": False}, {"num_householder": 3, "allow_neg_eigval": True},
                    paper):
        mine = ours("deltaproduct", 8, 32, "per_mixer", shape, options).layers[0].mixer.double()
        theirs = reference("fla_gated_deltaproduct", 8, 32, shape, options).model.layers[0].attn.double()
        names = [(o, f) for o, f in (("q_conv.conv", "q_conv1d"), ("k_conv.conv", "k_conv1d"), ("v_conv.conv", "v_conv1d"),
                                     *((n, n) for n in ("q_proj", "k_proj", "v_proj", "b_proj", "a_proj", "g_proj",
                                                        "o_proj", "o_norm")))
                 if getattr(mine, o.split(".")[0]) is not None]
        assert len(names) == (6 if options is paper else 11)
        assert {n for n, _ in theirs.named_parameters()} == {f + ".weight" for _, f in names} | (
            set() if options is paper else {"A_log", "dt_bias"})  # every weight of theirs is ours
        with torch.no_grad():
            for p in mine.parameters():
                p.normal_(0, 0.3)
            for ours_name, fla_name in names:
                theirs.get_submodule(fla_name).weight.copy_(mine.get_submodule(ours_name).weight)
            if options is not paper:
                theirs.A_log.copy_(mine.A_log)
                theirs.dt_bias.copy_(mine.dt_bias)
        x = torch.randn(2, 13, 32, dtype=torch.float64)
        theirs.train()  # chunk mode: the swapped product
        expected = mine(x)
        got = theirs(x)[0]  # fla's recurrence runs in float32 whatever its input
        assert expected.abs().mean() > 1e-3
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_gdn_language_study(tmp_path, capsys, data_cache):
    """Our gdn beside Qwen3-Next's GDN layers on the corpus, each in its own process (the reference's import blocks fla
    there): both land in runs.jsonl with their curves, the reference's parameter count is ours untied (the same
    shape), the table has both sides and the gap, the plot is written, a rerun trains nothing; bad input is one line."""
    from studies import gdn_language as study

    args = ["--variants", "reference_init", "--lrs", "1e-3", "--seeds", "0", "--steps", "1", "--eval-every", "1",
            "--max-documents", "40", "--jobs", "2", "--out", str(tmp_path)]
    assert study.main(args) == 0
    runs = {study.side(r): r for r in map(json.loads, (tmp_path / "runs.jsonl").read_text().splitlines())}
    assert set(runs) == {"ours, reference_init", "qwen3_next_gdn"}
    assert all([s for s, _ in r["curve"]] == [1] and 3 < r["bpb"] < 20 for r in runs.values())
    assert runs["ours, reference_init"]["params"] == runs["qwen3_next_gdn"]["params"]
    rows = {r[0]: r for r in table_rows((tmp_path / "table.md").read_text())[1:]}
    assert rows["qwen3_next_gdn"][5] == "+0.0000" and rows["ours, reference_init"][2] == "0.001 [single value]"
    assert (tmp_path / "curves.png").stat().st_size > 1000
    capsys.readouterr()
    assert study.main(args) == 0
    assert "2 runs, 2 already in" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown --variants 'dt'; valid: default, conv_uniform, conv_qk_uniform"):
        study.main(["--variants", "dt"])


def test_gdn_language_variants():
    """Each variant of ours changes what it names, from the library's start, and nothing else: dt_one puts
    softplus(dt_bias) at softplus(1) (from logU(1e-3, 1e-1)), conv_uniform the short-conv kernels at U(+-1/2) (from
    N(0, 0.02)), o_unscaled o_proj at std 0.02 (from 0.02 / sqrt(2 L)); untied, llama and reference_init have their
    own lm_head."""
    from studies import gdn_language as study

    def build(variant):
        torch.manual_seed(0)
        return study.build({"impl": "ours", "variant": variant}, 512)

    default = build("default")
    mixer = default.layers[0].mixer
    assert torch.nn.functional.softplus(mixer.dt_bias).max() <= 0.1 + 1e-6
    assert mixer.q_conv.conv.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert mixer.o_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    for variant, changed in (("dt_one", "dt_bias"), ("conv_uniform", "_conv."), ("o_unscaled", "o_proj")):
        model = build(variant)
        differ = {n for (n, a), b in zip(model.named_parameters(), default.parameters()) if not torch.equal(a, b)}
        assert differ and all(changed in n for n in differ), (variant, differ)
        m = model.layers[0].mixer
        if variant == "dt_one":
            assert torch.allclose(m.dt_bias, torch.ones_like(m.dt_bias))
        else:
            w, std = (m.q_conv.conv.weight, 0.5 / math.sqrt(3)) if variant == "conv_uniform" else (m.o_proj.weight, 0.02)
            assert w.std().item() == pytest.approx(std, rel=0.1)
    for variant in ("untied", "llama", "reference_init"):
        assert not build(variant).config.tie_word_embeddings


def timed_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# Each suite's timing helpers, made to call each function once (keyword names as the suites call them).
ONCE = {
    "interleaved": lambda fns, rounds=1, iters=1: {name: timed_once(fn) for name, fn in fns.items()},
    "cpu_interleaved": lambda fns, rounds=1: {name: timed_once(fn) for name, fn in fns.items()},
    "time_call": lambda fn, warmup=0, iters=1: timed_once(fn),
    "cpu_times": lambda fn, iters=1: [timed_once(fn)],
}


def small_stdlib(monkeypatch, files: int = 40):
    """data.text's stdlib corpus capped at the first `files` files, wherever a suite reads it."""
    from omegaconf import OmegaConf

    import data.text

    documents = data.text.stdlib_documents
    monkeypatch.setattr(data.text, "stdlib_documents",
                        lambda cfg: documents(OmegaConf.merge(cfg, {"max_documents": files})))


@pytest.mark.parametrize("suite", BENCH_SUITES)
def test_bench_suite_runs(suite, tmp_path, monkeypatch, data_cache):
    """Every suite of scripts/bench.py, each timing once: its tables hold finite numbers, and each ratio it
    reports is the ratio of the columns it is computed from (to the digits printed); a suite's own
    correctness columns (agreement with its peer) are within their tolerance."""
    import importlib

    module = importlib.import_module(f"scripts.benchmarks.{suite}")
    for name, fn in ONCE.items():
        if hasattr(module, name):
            monkeypatch.setattr(module, name, fn)
    if suite == "data":  # 2.2 MB corpora (>100 files: the peer cuts 64 shards, val holds out every 100th) for 50 and 5 MB
        small_stdlib(monkeypatch)
        make_corpus = module.make_corpus
        monkeypatch.setattr(module, "WORK", tmp_path)
        monkeypatch.setattr(module, "make_corpus", lambda folder, size: make_corpus(folder, min(size, 2_200_000)))
        # the default model's speed: 1 timed step after the first; the loader's: 0.05 s per setting
        tokens_per_sec, loader = module.default_model_tokens_per_sec, module.loader_throughput
        monkeypatch.setattr(module, "default_model_tokens_per_sec", lambda steps: tokens_per_sec(1))
        monkeypatch.setattr(module, "loader_throughput", lambda *args: loader(*args[:3], 0.05))
    if suite == "ep":  # its two launches on a port of their own (tests may run side by side), the tiny model, 4 steps
        monkeypatch.setattr(module, "LAUNCH", ddp_launcher())
        train = module.train
        monkeypatch.setattr(module, "train", lambda run_dir, steps, *overrides: train(run_dir, 4, *TINY_MODEL, *overrides))
    if suite == "recipe":  # the tiny model, 4 steps, on 40 files (ours, the peer in its process, the val split)
        small_stdlib(monkeypatch)
        monkeypatch.setattr(module, "WORK", tmp_path)
        # the peer: one step on 40 files (its wall-clock budget, our run's wall time, only times it)
        loop = "while (elapsed := time.time() - t0) < train_seconds:"
        peer = module.PEER.replace('{"max_documents": None', '{"max_documents": 40').replace(
            loop, loop[:-1] + " or step == 0:")
        assert peer.count('{"max_documents": 40') == 1 and peer.count("< train_seconds or step == 0:") == 1
        monkeypatch.setattr(module, "PEER", peer)
        train_peer = module.train_peer
        monkeypatch.setattr(module, "train_peer", lambda budget: train_peer(0.0))
        # both models scored on the first 4,000 characters of each val document (several windows each)
        val_documents = module.val_documents
        monkeypatch.setattr(module, "val_documents", lambda: [d[:4000] for d in val_documents()])
        train_ours = module.train_ours
        monkeypatch.setattr(module, "train_ours", lambda name, overrides, cache: train_ours(
            name, [*TINY_MODEL, "trainer.max_steps=4", "trainer.eval_batches=1", "trainer.sample_tokens=0", *overrides],
            cache))
    report = module.run(quick=True)
    assert table_rows(report) and not re.search(r"\b(nan|inf)\b", report, re.IGNORECASE), report
    BENCH_CHECKS.get(suite, lambda report: None)(report)


def tables(markdown: str) -> list[list[dict]]:
    """The markdown tables of a report, each a list of {header: cell} rows (a header repeated in a table: its later
    columns named '<header> (2)', ...)."""
    out, header = [], None
    for line in markdown.splitlines() + [""]:
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set("".join(cells)) <= set("-: "):
            continue
        if header is None:
            header = [c if cells[:i].count(c) == 0 else f"{c} ({cells[:i].count(c) + 1})" for i, c in enumerate(cells)]
            out.append([])
        else:
            out[-1].append(dict(zip(header, cells)))
    return out


def number(cell: str) -> float:
    """A report cell as a number: '1,426' -> 1426, '1.38x' -> 1.38, '17.3%' -> 0.173, '8 s (5 s setup)' -> 8."""
    text = cell.replace(",", "").strip()
    value = float(re.match(r"[-+0-9.e]+", text).group(0))
    return value / 100 if text.endswith("%") else value


def half_unit(cell: str) -> float:
    """Half a unit in a report cell's last printed digit: '0.054' -> 0.0005."""
    mantissa = re.match(r"[-+0-9.]+", cell.replace(",", "").strip()).group(0)
    return 0.5 * 10 ** -len(mantissa.partition(".")[2])


def rounding(cell: str) -> float:
    """Half a unit in a report cell's last printed digit, relative to its value: '0.054' -> 0.0005 / 0.054."""
    mantissa = float(re.match(r"[-+0-9.]+", cell.replace(",", "").strip()).group(0))
    return half_unit(cell) / abs(mantissa) if mantissa else math.inf


def assert_ratio(rows: list[dict], ratio: str, num, den, digits: float = 0.02):
    """Each row's `ratio` column equals num(row) / den(row), cells both, to `digits` (relative) beyond what
    rounding the two printed cells can move their quotient, and half a unit of the ratio's own last printed digit
    (0.09 printed for 0.086 of unrounded times, 0.084 from the printed ones)."""
    for row in rows:
        if row.get(ratio):
            want = number(num(row)) / number(den(row))
            rel = digits + rounding(num(row)) + rounding(den(row))
            printed = number(row[ratio])
            assert abs(printed - want) <= rel * want + half_unit(row[ratio]) + 1e-3, (ratio, row, want)


def check_data(report):
    (prep, rss, loader) = tables(report)
    assert prep[0]["tokens"] == prep[1]["tokens"] and number(prep[1]["tokens"]) > 0  # the same corpus, tokenized alike
    for row in loader:  # tokens/s = batches/s x 8 x 256 tokens
        assert number(row["tokens/s"]) == pytest.approx(number(row["batches/s"]) * 2048, rel=0.01, abs=2048), row
    assert number(rss[2]["MB"]) == pytest.approx(number(rss[0]["MB"]) - number(rss[1]["MB"]), abs=1)  # MB rounded


def check_docmask(report):
    (rows,) = tables(report)
    assert [r["mixer"] for r in rows] == MIXERS.names()
    assert_ratio(rows, "masked / plain", lambda r: r["tokens/s masked"], lambda r: r["tokens/s plain"])
    assert_ratio(rows, "padded / masked", lambda r: r["tokens/s padded"], lambda r: r["tokens/s masked"])


def check_dsa(report):
    cases = tables(report)[0]
    dense = cases[0]["CPU ms"]
    assert_ratio(cases, "speed-up vs dense fwd+bwd", lambda r: dense, lambda r: r["CPU ms"], digits=0.05)


def check_ep(report):
    (rows,) = tables(report)
    ddp = rows[0]
    assert_ratio(rows, "step / DDP", lambda r: r["step s"], lambda r: ddp["step s"], digits=0.01)
    assert_ratio(rows, "memory / DDP", lambda r: r["peak RSS GB (rank 0)"], lambda r: ddp["peak RSS GB (rank 0)"],
                 digits=0.01)
    assert number(rows[1]["all-to-all MB sent per step (rank)"]) > 0  # the split experts' rows did travel


def check_cp(report):
    """Memory and speed against CP 1 of the same mixer and length, and the bytes sent per layer as the cost model
    has them."""
    (rows,) = tables(report)
    base = {(r["mixer"], r["T"]): r for r in rows if r["CP"] == "1"}
    rows = [r for r in rows if (r["mixer"], r["T"]) in base]  # past one process's lengths: no ratio
    assert_ratio(rows, "vs CP 1", lambda r: r["step memory / rank MiB"],
                 lambda r: base[r["mixer"], r["T"]]["step memory / rank MiB"], digits=0.01)
    assert_ratio(rows, "vs CP 1 (2)", lambda r: r["tokens/s"], lambda r: base[r["mixer"], r["T"]]["tokens/s"], digits=0.01)
    split = [r for r in rows if r["CP"] != "1"]
    assert split and all(number(r["KiB sent / layer / step"]) == pytest.approx(
        number(r["model: mixer / activations KiB"].split("/")[0]), rel=0.01) for r in split), split


def check_gdn(report):
    op, model = tables(report)
    # the last column, max |o - o_tf| (its header's bars split it in two cells): our op computes transformers' rule
    assert all(number(list(r.values())[-1]) < 1e-5 for r in op), op
    tf64 = next(r["ms"] for r in op if r["op"] == "transformers, chunk 64")
    assert_ratio(op, "speed vs tf chunk 64", lambda r: tf64, lambda r: r["ms"], digits=0.05)
    tf = next(r["tokens/s"] for r in model if r["model"].startswith("transformers"))
    assert_ratio(model, "speed vs transformers", lambda r: r["tokens/s"], lambda r: tf)
    assert len({r["params"] for r in model}) == 1  # the same model on both sides


def check_delta(report):
    """Both tables (ops, one mixer layer): the family's cases beside softmax, backward the difference of the two
    timings, every ratio the ratio of its columns."""
    for rows in tables(report):
        assert [r["case"] for r in rows][1:] == ["gdn", "deltanet", "kda", "gdn2", "deltaproduct n=2",
                                                 "deltaproduct n=3"] and rows[0]["case"].startswith("softmax"), rows
        softmax, gdn = rows[0], rows[1]
        for r in rows:
            bwd = number(r["fwd+bwd ms"]) - number(r["fwd ms"])
            assert number(r["bwd ms"]) == pytest.approx(bwd, abs=0.11), r
        assert_ratio(rows, "time / softmax", lambda r: r["fwd+bwd ms"], lambda r: softmax["fwd+bwd ms"])
        assert_ratio(rows, "time / gdn", lambda r: r["fwd+bwd ms"], lambda r: gdn["fwd+bwd ms"])
        assert_ratio(rows, "fwd / gdn fwd", lambda r: r["fwd ms"], lambda r: gdn["fwd ms"])
        assert_ratio(rows, "bwd / gdn bwd", lambda r: r["bwd ms"], lambda r: gdn["bwd ms"])


def check_mamba2(report):
    assert all(float(d) < 1e-3 for d in re.findall(r"max \|\w+ - \w+\|(?: with shared weights)? = ([0-9.e+-]+)", report))
    op, model = tables(report)
    tf = next(r["ms"] for r in op if r["op"].startswith("transformers"))
    assert_ratio(op, "speed vs transformers", lambda r: tf, lambda r: r["ms"], digits=0.05)
    peer = next(r["tokens/s"] for r in model if r["model"].startswith("transformers"))
    assert_ratio(model, "speed vs transformers", lambda r: r["tokens/s"], lambda r: peer)


def check_model(report):
    (rows,) = tables(report)
    llama = next(r["tokens/s"] for r in rows if r["model"].startswith("transformers Llama"))
    assert_ratio(rows, "vs Llama", lambda r: r["tokens/s"], lambda r: llama)


def check_moe(report):
    layers, cpu, routers = tables(report)
    for shape in {r["shape"] for r in layers}:
        rows = [r for r in layers if r["shape"] == shape]
        eager = next(r["fwd+bwd ms"] for r in rows if r["impl"] == "transformers eager")
        assert_ratio(rows, "speed-up vs eager", lambda r: eager, lambda r: r["fwd+bwd ms"], digits=0.03)
    assert {r["router"].split(",")[0] for r in routers} <= set(ROUTERS.names()) and routers[0]["router"] == "topk"
    topk, topk_cpu = routers[0]["fwd+bwd ms"], routers[0]["CPU ms, 1 thread"]
    assert_ratio(routers, "x top-k", lambda r: r["fwd+bwd ms"], lambda r: topk, digits=0.03)
    assert_ratio(routers, "x top-k (2)", lambda r: r["CPU ms, 1 thread"], lambda r: topk_cpu, digits=0.03)


def check_recipe(report):
    (rows,) = tables(report)
    assert rows[0]["train tokens"] == "4,096"  # the peer trained its one step of 16 x 256 tokens
    assert all(0 < number(r["val bpb"]) < 10 for r in rows)
    assert_ratio(rows, "bpb / peer", lambda r: r["val bpb"], lambda r: rows[0]["val bpb"], digits=0.002)


def check_scaling(report):
    (rows,) = tables(report)
    assert [r["mixer"] for r in rows] == MIXERS.names()
    assert_ratio(rows, "t(512)/t(256)", lambda r: r["T=512"], lambda r: r["T=256"])


def check_decode(report):
    (rows,) = tables(report)
    assert [r["context"] for r in rows] == ["256", "512"]
    assert_ratio(rows, "ours / Llama", lambda r: r["ours tokens/s"], lambda r: r["transformers Llama tokens/s"])


BENCH_CHECKS = {"cp": check_cp, "data": check_data, "decode": check_decode, "delta": check_delta,
                "docmask": check_docmask, "dsa": check_dsa, "ep": check_ep, "gdn": check_gdn,
                "mamba2": check_mamba2, "model": check_model, "moe": check_moe, "recipe": check_recipe,
                "scaling": check_scaling}
