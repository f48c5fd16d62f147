"""eval.py's suites (evaluation/suites/): the passkey sits where it is said to at every depth, its graded
scores (forced choice, lift, copy) are what a direct computation gives and grade a copying model above a
blind one, the length suite scores every position past the training length in bands of the last half, the decode cache holds what each mixer's state
analytically is, and `python eval.py ... suite=[length,recall,decode]` writes them all."""
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from conftest import ROOT
from data.types import Split
from model.config import LMConfig
from model.lm import DecoderLM
from model.registry import MIXERS
from evaluation.suites.decode import decode_costs
from evaluation.per_position import log_binned
from evaluation.suites.length import bands, loss_by_length
from evaluation.recall_probes import (copy_example, copy_losses, filler_stream, first_place_share, mqar_recall,
                                      passkey_example, passkey_recall, passkey_trials, score_continuations, without_needle)
from evaluation.suites.recall import Recall, RecallOptions
from model.lm import DecodeCache
from model.options import parse_options
from evaluation.validation import check_eval_config

pytestmark = pytest.mark.usefixtures("one_thread")

DSA = {"topk": 4, "index_heads": 2, "index_head_dim": 8, "index_rope_dim": 4}


def tiny_lm(mixer: str, max_positions: int = 64, vocab: int = 64) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(LMConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=64, max_position_embeddings=max_positions,
                              mixer=mixer, mixer_options={"dsa": DSA})).eval()


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE trained in-process on text with digits, so keys split into multi-digit tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    text = [f'x{i} = "{i * 7919 % 100000}"\ndef f(a, b):\n    return a + b  # passkey\n' for i in range(300)]
    bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"], show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


# ---- recall --------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
def test_the_passkey_sits_at_its_depth(tokenizer, depth):
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    filler = torch.arange(1000, 1500)  # ids the tokenizer never makes: the filler is told apart from the rest
    context, key = 200, "48213"
    ids, answer, at_needle = passkey_example(filler, tokenizer, context, depth, key)
    needle = enc("\n") + enc('passkey = "') + enc(key) + enc('"\n')
    query = enc("\n") + enc('passkey = "')
    filler_size = context - len(needle) - len(query) - len(answer)
    assert len(ids) + len(answer) == context
    p = round(depth * filler_size)
    assert at_needle == slice(p, p + len(needle))
    assert ids[:p].tolist() == list(range(1000, 1000 + p))  # the filler before the needle, in order
    assert ids[p:p + len(needle)].tolist() == needle
    assert ids[p + len(needle):len(ids) - len(query)].tolist() == list(range(1000 + p, 1000 + filler_size))
    assert ids[-len(query):].tolist() == query
    at = p + len(enc("\n")) + len(enc('passkey = "'))
    assert ids[at:at + len(answer)].tolist() == answer.tolist() and tokenizer.decode(answer) == key
    # the same haystack without the needle: the filler in order, then the query
    assert without_needle(ids, at_needle).tolist() == list(range(1000, 1000 + filler_size)) + query


def test_a_greedy_answer_scores_as_generate_decodes():
    """score_continuations' greedy flag is greedy decoding and its log-probs generate's scores, for each continuation
    of a batch of different lengths (right-padded after the prompt's cache)."""
    lm = tiny_lm("softmax")
    prompt = torch.randint(64, (20,), generator=torch.Generator().manual_seed(1))
    out = lm.generate(prompt[None], attention_mask=torch.ones(1, 20, dtype=torch.long), max_new_tokens=4,
                      do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    answer = out.sequences[0, 20:]
    logprobs = torch.stack([s[0].log_softmax(-1)[t] for s, t in zip(out.scores, answer)])
    wrong = answer.clone()
    wrong[-1] = (wrong[-1] + 1) % 64
    scored, greedy = score_continuations(lm, prompt, [answer[:2], answer, wrong, answer[:1]], "cpu")
    assert greedy == [True, True, False, True]
    for lp, n in zip(scored, (2, 4, 3, 1)):
        torch.testing.assert_close(lp[:n], logprobs[:n], rtol=0, atol=1e-5)
    assert scored[2][3] < logprobs[3]  # the changed last token is not the argmax


def test_recall_suite_grid(tokenizer):
    lm = tiny_lm("softmax", max_positions=128, vocab=len(tokenizer))
    val = Split(torch.randint(1, 300, (8, 32), generator=torch.Generator().manual_seed(0)))
    report = passkey_recall(lm, tokenizer, val, [64, 128, 256], [0.0, 1.0], 2, 10, 8, 0, "cpu")
    assert report["contexts"] == [64, 128] and "exceed max_position_embeddings=128" in report["skipped"]["256"]
    assert all(len(report[k]) == 2 and all(len(row) == 2 for row in report[k])
               for k in ("acc", "answer_logprob", "choice_acc", "lift"))
    assert len(report["copy"]) == 2 and report["copy"] == [b - a for a, b in zip(report["copy_first_loss"],
                                                                                   report["copy_second_loss"])]
    scores = Recall().scores(report)
    assert set(scores) == {"recall/answer_logprob", *(f"recall/{name}{at}" for name in ("acc", "choice_acc", "lift", "copy")
                                                       for at in ("", "@64", "@128"))}
    assert scores["recall/answer_logprob"] < 0
    assert scores["recall/choice_acc@64"] == pytest.approx(np.mean(report["choice_acc"][0]))
    assert scores["recall/copy"] == pytest.approx(np.mean(report["copy"]))


COPY_LOGIT = 10.0


class Copier:
    """A stand-in LM that copies (an induction oracle): at each position, the token that followed the latest earlier
    occurrence of the longest suffix (up to 8 tokens) of the sequence so far gets logit COPY_LOGIT, every other token
    0; with no earlier occurrence every logit is 0 (uniform). It keeps the tokens seen in a DecodeCache, so the
    suite's cached scoring (a prompt, then continuations side by side) runs as on a DecoderLM."""

    def __init__(self, vocab: int):
        self.config = SimpleNamespace(vocab_size=vocab, max_position_embeddings=4096, layer_mixers=[])
        self.layers = []

    @staticmethod
    def next_token(seen: np.ndarray) -> int | None:
        for k in range(min(8, len(seen) - 1), 0, -1):
            earlier = np.lib.stride_tricks.sliding_window_view(seen[:-1], k)  # windows ending before the last token
            starts = np.flatnonzero((earlier == seen[-k:]).all(1))
            if len(starts):
                return int(seen[starts[-1] + k])
        return None

    def __call__(self, input_ids, past_key_values=None, use_cache=None, logits_to_keep=0, **_):
        if past_key_values is None and use_cache:
            past_key_values = DecodeCache(1)
        layer = past_key_values.layers[0] if past_key_values is not None else {}
        full = torch.cat([layer["tokens"], input_ids], 1) if "tokens" in layer else input_ids
        layer["tokens"] = full
        ends = range(full.shape[1] - (logits_to_keep or input_ids.shape[1]), full.shape[1])
        logits = torch.zeros(len(full), len(ends), self.config.vocab_size)
        for b, row in enumerate(full.numpy()):
            for i, t in enumerate(ends):
                if (token := self.next_token(row[:t + 1])) is not None:
                    logits[b, i, token] = COPY_LOGIT
        return SimpleNamespace(logits=logits, past_key_values=past_key_values)


def uniform_lm(vocab: int) -> DecoderLM:
    """A DecoderLM whose logits are all 0: every token has probability 1 / vocab wherever it stands."""
    lm = tiny_lm("softmax", max_positions=256, vocab=vocab)
    with torch.no_grad():
        lm.lm_head.weight.zero_()
    return lm


def arange_val(blocks: int = 4, length: int = 64, start: int = 1000) -> Split:
    """Val text of distinct tokens (ids the test tokenizers never make), so nothing in a haystack repeats."""
    return Split(torch.arange(start, start + blocks * length).view(blocks, length))


def test_first_place_share_is_the_expected_credit_of_a_random_tie_break():
    assert first_place_share([-1.0, -2.0, -3.0]) == 1.0
    assert first_place_share([-2.0, -1.0, -3.0]) == 0.0
    assert first_place_share([-1.0, -1.0, -3.0, -1.0]) == pytest.approx(1 / 3)
    assert first_place_share([-5.0] * 10) == pytest.approx(0.1)


def test_a_copying_model_finds_the_key_every_time(tokenizer):
    """The induction oracle reads the key back from the needle: exact match and forced choice 1 at every context and
    depth; each answer token gets log-prob COPY_LOGIT - log(e^COPY_LOGIT + V - 1); without the needle the query has no
    earlier occurrence, so the key is uniform (log p = -|key| log V) and the lift is at least log V."""
    V = 1400
    report = passkey_recall(Copier(V), tokenizer, arange_val(), [64, 128], [0.0, 0.5, 1.0], 3, 10, 8, 0, "cpu")
    assert report["contexts"] == [64, 128]
    assert report["acc"] == [[1.0] * 3] * 2 and report["choice_acc"] == [[1.0] * 3] * 2
    per_token = COPY_LOGIT - math.log(math.exp(COPY_LOGIT) + V - 1)
    assert np.array(report["answer_logprob"]) == pytest.approx(per_token, abs=1e-5)
    assert min(min(row) for row in report["lift"]) > math.log(V) + per_token


def test_a_uniform_model_scores_chance_exactly():
    """Logits all 0 and a tokenizer of one token per character (every key 5 tokens): every candidate scores
    -5 log V, all 10 tie, and the tie rule credits 1/10 in every cell; the needle changes nothing (lift 0) and a
    repeated span is no easier (copy 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    chars = Tokenizer(models.BPE())
    chars.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    chars.train_from_iterator(["passkey"], trainers.BpeTrainer(vocab_size=257, special_tokens=["<eos>"], show_progress=False,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=chars, eos_token="<eos>")
    assert len(tokenizer.encode("48213", add_special_tokens=False)) == 5
    report = passkey_recall(uniform_lm(1300), tokenizer, arange_val(start=300), [64, 128], [0.0, 1.0], 3, 10, 8, 0, "cpu")
    assert np.array(report["choice_acc"]) == pytest.approx(0.1, rel=1e-12) and report["acc"] == [[0.0, 0.0]] * 2
    assert report["lift"] == [[0.0, 0.0]] * 2
    assert report["copy"] == pytest.approx([0.0, 0.0], abs=1e-6)
    assert report["copy_first_loss"] == pytest.approx([math.log(1300)] * 2)


@pytest.mark.parametrize("mixer", ["softmax", "gdn"])
def test_graded_scores_are_the_direct_computation(tokenizer, mixer):
    """Each cell against full forwards of prompt + candidate (no cache, no batching), with the prompt without the
    needle built here from its pieces: lift = log p(key | needle) - log p(key | no needle) (nats per key), forced
    choice by the whole candidate's log-prob, exact match by the argmax; the trials drawn as the suite draws them."""
    lm = tiny_lm(mixer, max_positions=128, vocab=len(tokenizer))
    val = Split(torch.randint(1, 300, (8, 32), generator=torch.Generator().manual_seed(0)))
    context, depths, trials = 96, [0.0, 0.5, 1.0], 3
    report = passkey_recall(lm, tokenizer, val, [context], depths, trials, 4, 8, 0, "cpu")
    enc = lambda s: torch.tensor(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731

    def key_logprobs(prompt, key):
        seq = torch.cat([prompt, key])
        with torch.no_grad():
            logprobs = lm(seq[None]).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        return logprobs.gather(-1, key[:, None])[:, 0], bool((logprobs.argmax(-1) == key).all())

    stream = filler_stream(val, context, tokenizer.eos_token_id)
    drawn = passkey_trials(stream, context, trials, 4, 0)
    for j, depth in enumerate(depths):
        lift, choice, hits = [], [], []
        for key, window, others in drawn:
            ids, answer, _ = passkey_example(window, tokenizer, context, depth, key)
            query = torch.cat([enc("\n"), enc('passkey = "')])
            size = context - 2 * len(query) - 2 * len(answer) - len(enc('"\n'))
            absent = torch.cat([window[:size], query])
            totals = [key_logprobs(ids, enc(k))[0].sum().item() for k in (key, *others)]
            lift.append(totals[0] - key_logprobs(absent, answer)[0].sum().item())
            choice.append(float(totals[0] > max(totals[1:])))
            hits.append(key_logprobs(ids, answer)[1])
        assert report["lift"][0][j] == pytest.approx(np.mean(lift), abs=1e-4)
        assert report["choice_acc"][0][j] == np.mean(choice) and report["acc"][0][j] == np.mean(hits)


@pytest.mark.parametrize("C", [64, 67])
def test_the_copy_span_sits_twice_half_the_context_apart(C):
    window, span = torch.arange(100, 100 + C), 16
    ids, first, second = copy_example(window, span)
    lead = C // 2 - span
    assert len(ids) == C
    assert ids[lead:lead + span].tolist() == ids[C - span:].tolist() == list(range(100, 100 + span))
    assert ids[:lead].tolist() + ids[lead + span:C - span].tolist() == list(range(100 + span, 100 + C - span))
    assert (first, second) == (slice(lead + 1, lead + span), slice(C - span + 1, C))  # each occurrence but its first token


def test_copy_score_of_a_copier_and_of_a_blind_model():
    """The induction oracle: the span's first occurrence has nothing to copy (uniform, log V per token), the second
    is copied (COPY_LOGIT on the right token), so copy = log(e^COPY_LOGIT + V - 1) - COPY_LOGIT - log V < 0. A model
    that does not copy (logits all 0) scores 0."""
    V, windows = 1300, torch.arange(1000, 1256).view(2, 128)
    first, second = copy_losses(Copier(V), windows, 16, "cpu")
    assert first == pytest.approx(math.log(V), rel=1e-6)
    assert second - first == pytest.approx(math.log(math.exp(COPY_LOGIT) + V - 1) - COPY_LOGIT - math.log(V), rel=1e-5)
    first, second = copy_losses(uniform_lm(V), windows, 16, "cpu")
    assert second - first == pytest.approx(0.0, abs=1e-6)


def test_recall_options_are_checked_once():
    assert RecallOptions().candidates == 10
    with pytest.raises(ValueError, match=r"^recall suite candidates=1; valid: an integer >= 2$"):
        parse_options("recall suite", RecallOptions, {"candidates": 1})
    with pytest.raises(ValueError, match=r"^recall suite copy_span=20; valid: an integer >= 2 and <= min\(recall.contexts\) / 4 = 16$"):
        parse_options("recall suite", RecallOptions, {"contexts": [64, 128], "copy_span": 20})


def test_mqar_grid():
    report = mqar_recall(tiny_lm("gdn", max_positions=16), OmegaConf.create({"vocab_size": 64, "power_a": 0.01}),
                        [16, 32], [2, 8], 4, 0, "cpu")["mqar"]
    assert report["acc"][0][1] is None and "T16_kv8" in report["skipped"]  # 16 < 4 x 8
    assert all(0 <= a <= 1 for a in (report["acc"][0][0], *report["acc"][1]))  # gdn: no position bound at 32
    assert "recall/mqar_acc@T32_kv8" in Recall().scores({"mqar": report})


# ---- length --------------------------------------------------------------------------------------
def test_length_scores_every_position_past_the_training_length():
    T = 8
    lm = tiny_lm("softmax", max_positions=8 * T)
    val = {k * T: Split(torch.randint(64, (3, k * T), generator=torch.Generator().manual_seed(k))) for k in (1, 2, 4, 8)}
    report = loss_by_length(lm, val.get, T, [1, 2, 4, 8, 16], 3, 2 * 8 * T, "cpu")
    assert report["seq_lens"] == [T, 2 * T, 4 * T, 8 * T]
    assert report["positions_scored"] == {str(k * T): k * T - 1 for k in (1, 2, 4, 8)}
    assert "exceed max_position_embeddings=64" in report["skipped"]["16x"]
    ids = val[8 * T].input_ids
    with torch.no_grad():
        expected = F.cross_entropy(lm(ids).logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(0)
    assert report["per_position"][str(8 * T)] == pytest.approx(expected.tolist(), abs=1e-5)
    assert report["bands"]["1x"] == pytest.approx(expected[T // 2:T].mean().item(), abs=1e-5)  # (T/2, T]
    assert report["bands"]["8x"] == pytest.approx(expected[4 * T:].mean().item(), abs=1e-5)  # (4T, 8T - 1]


def test_length_without_positions_goes_past_the_bound():
    T = 8
    report = loss_by_length(tiny_lm("gdn", max_positions=T), lambda L: Split(torch.randint(64, (2, L))), T, [1, 4], 2,
                          64, "cpu")
    assert report["seq_lens"] == [T, 4 * T] and report["positions_scored"][str(4 * T)] == 4 * T - 1


def test_length_takes_single_document_blocks():
    """With document masking, a block that crosses a document start is not scored."""
    class Masked(Split):
        def batch(self, index):
            out = super().batch(index)
            positions = torch.arange(16).repeat(len(index), 1)
            positions[index % 2 == 1, 10:] -= 10  # odd blocks: a document starts at 10
            return {**out, "position_ids": positions}

    ids = torch.randint(64, (6, 16))
    report = loss_by_length(tiny_lm("softmax"), lambda L: Masked(ids), 16, [1], 8, 64, "cpu")
    assert report["sequences"] == {"16": 3}


@pytest.mark.parametrize("T", [8, 7])
def test_length_bands_are_the_last_half_of_each_length(T):
    """loss = target position p: band "kx" is the mean of p over ((k/2) T, k T], cut at the L - 1 = 8T - 1 positions
    there are; "1x" is (T/2, T], not [1, T]."""
    per_position = [float(p) for p in range(1, 8 * T)]
    expected = {f"{k}x": np.mean([p for p in range(1, 8 * T) if k * T / 2 < p <= k * T]) for k in (1, 2, 4, 8)}
    assert bands(per_position, T, [1, 2, 4, 8]) == pytest.approx(expected)
    assert bands(per_position, 8, [1])["1x"] == 6.5  # positions 5..8


# ---- decode --------------------------------------------------------------------------------------
def test_softmax_cache_is_its_kv():
    """2 (K, V) x layers x kv heads x head_dim x T x 4 bytes (fp32), GQA: kv heads, not query heads; each batch
    size decoded, in its order, the row's decode figures being the first's."""
    report = decode_costs(tiny_lm("softmax"), [16, 32], 2, [1, 3], 0, "cpu")
    for row in report["rows"]:
        assert row["cache_bytes"] == 2 * 2 * 2 * 8 * row["context"] * 4
        assert row["cache_bytes_per_layer"] == [row["cache_bytes"] // 2] * 2
        assert [b["batch"] for b in row["batches"]] == [1, 3]
        assert row["decode_tokens_per_sec"] == row["batches"][0]["tokens_per_sec"]
        assert row["decode_peak_mem_bytes"] == row["batches"][0]["peak_mem_bytes"]
        assert row["prefill_tokens_per_sec"] > 0 and row["prefill_peak_mem_bytes"] >= 0
        assert all(b["tokens_per_sec"] > 0 and b["peak_mem_bytes"] >= 0 for b in row["batches"])


def test_dsa_cache_is_kv_and_indexer_keys():
    """Per layer and token: K and V (kv heads x head_dim each) and one indexer key (index_head_dim)."""
    for row in decode_costs(tiny_lm("dsa"), [16, 32], 2, [1], 0, "cpu")["rows"]:
        assert row["cache_bytes"] == 2 * (2 * 2 * 8 + DSA["index_head_dim"]) * row["context"] * 4


@pytest.mark.parametrize("mixer", MIXERS.names())
def test_a_cache_is_a_fixed_state_or_grows_with_each_token(mixer):
    """What the decode suite reports of any mixer: a recurrent state of fixed size, or keys (and values) that
    grow by the same bytes for every token of the context, nothing in between."""
    small, large = (row["cache_bytes"] for row in decode_costs(tiny_lm(mixer), [16, 48], 2, [1], 0, "cpu")["rows"])
    assert small > 0 and (large == small or large == 3 * small), (small, large)


def test_decode_measures_past_the_position_bound():
    """Decode measures cost, which positions past max_position_embeddings (64 here) do not change: every
    model is measured there (softmax's cache holds all 128 prompt tokens' keys and values, gdn's state is the
    size it has at 60), and the bound is restored after."""
    for mixer in ("softmax", "gdn"):
        lm = tiny_lm(mixer)
        rows = decode_costs(lm, [60, 128], 4, [1], 0, "cpu")["rows"]
        assert [row["context"] for row in rows] == [60, 128] and not any("skipped" in row for row in rows)
        assert all(row["prefill_tokens_per_sec"] > 0 and row["decode_tokens_per_sec"] > 0 for row in rows)
        if mixer == "softmax":  # 2 (K, V) x 2 layers x 2 kv heads x 8 dims x 4 bytes per token
            assert [row["cache_bytes"] for row in rows] == [2 * 2 * 2 * 8 * 4 * t for t in (60, 128)]
        else:
            assert rows[0]["cache_bytes"] == rows[1]["cache_bytes"] > 0
        assert lm.config.max_position_embeddings == 64


# ---- eval.py -------------------------------------------------------------------------------------
def test_a_bad_suite_is_one_line():
    cfg = OmegaConf.load(ROOT / "configs" / "eval.yaml")
    cfg.suite = ["nope"]
    with pytest.raises(ValueError, match=r"^suite=\['nope'\]: unknown suite 'nope'; valid: decode, length, recall$"):
        check_eval_config(cfg)


@pytest.mark.slow
def test_eval_py_runs_the_suites(tiny_run, data_cache, tmp_path):
    run, _ = tiny_run  # T = 64, softmax, max_position_embeddings 4096
    cmd = [sys.executable, str(ROOT / "eval.py"), f"checkpoint={run}", f"out_dir={tmp_path}", "suite=[length,recall,decode]",
           "length.factors=[1,2,4]", "length.sequences=2", "recall.contexts=[128,256]", "recall.depths=[0,0.5,1]",
           "recall.trials=2", "decode.contexts=[64,128]", "decode.tokens=8", "batches=1", "sample_tokens=0", "wandb=false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "eval.json").read_text())
    length = report["length"]
    assert length["train_seq_len"] == 64 and set(length) >= {"seq_lens", "per_position", "bands", "positions_scored", "skipped"}
    for L in length["seq_lens"]:
        assert len(length["per_position"][str(L)]) == L - 1 == length["positions_scored"][str(L)]
    assert report["recall"]["contexts"] == [128, 256] and report["recall"]["depths"] == [0, 0.5, 1]
    assert len(report["recall"]["acc"]) == 2 and report["recall"]["trials"] == 2
    rows = report["decode"]["rows"]
    assert rows[0]["cache_bytes"] == 2 * 2 * 2 * 16 * 64 * 4 and rows[1]["cache_bytes"] == 2 * rows[0]["cache_bytes"]
    scores = report["scores"]
    assert {"recall/acc", "recall/acc@128", "recall/answer_logprob", "recall/choice_acc@256", "recall/lift@128",
            "recall/copy@256", "decode/tokens_per_sec@64",
            "decode/prefill_tokens_per_sec@64", "decode/peak_mem_gb@64", "decode/cache_bytes@64"} <= set(scores)
    assert {f"length/loss_{band}" for band in length["bands"]} <= set(scores) and "length/loss_1x" in scores
    for png in ("length_loss.png", "recall_heatmap.png", "decode.png", "per_position_loss.png"):
        assert (tmp_path / png).stat().st_size > 0


def test_log_binned_averages_within_bins():
    """loss = position: each bin's mean loss is its mean position; a step in the loss stays a step."""
    x, y = log_binned([float(p) for p in range(1, 2048)], bins=20)
    assert x == y and x[0] == 1.0 and x == sorted(x) and len(x) <= 20
    x, y = log_binned([1.0] * 127 + [3.0] * 1920, bins=11)  # edges 1, 2, 4, ..., 2048: the step at 128 is an edge
    assert y == [1.0] * 7 + [3.0] * 4
