"""eval.py's suites (evaluation/suites/): the passkey sits where it is said to at every depth, the length
suite scores every position past the training length, the decode cache holds what each mixer's state
analytically is, and `python eval.py ... suite=[length,recall,decode]` writes them all."""
import json
import subprocess
import sys

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
from evaluation.suites.length import bands, log_binned, loss_by_length
from evaluation.suites.recall import Recall, mqar_recall, passkey_example, passkey_recall, score_answer
from training.validation import check_eval_config

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
    ids, answer, p = passkey_example(filler, tokenizer, context, depth, key)
    needle = enc("\n") + enc('passkey = "') + enc(key) + enc('"\n')
    query = enc("\n") + enc('passkey = "')
    filler_size = context - len(needle) - len(query) - len(answer)
    assert len(ids) + len(answer) == context
    assert p == round(depth * filler_size)
    assert ids[:p].tolist() == list(range(1000, 1000 + p))  # the filler before the needle, in order
    assert ids[p:p + len(needle)].tolist() == needle
    assert ids[p + len(needle):len(ids) - len(query)].tolist() == list(range(1000 + p, 1000 + filler_size))
    assert ids[-len(query):].tolist() == query
    at = p + len(enc("\n")) + len(enc('passkey = "'))
    assert ids[at:at + len(answer)].tolist() == answer.tolist() and tokenizer.decode(answer) == key


def test_a_greedy_answer_scores_as_generate_decodes():
    """score_answer's exact match is greedy decoding and its log-prob the mean over the answer tokens."""
    lm = tiny_lm("softmax")
    prompt = torch.randint(64, (20,), generator=torch.Generator().manual_seed(1))
    out = lm.generate(prompt[None], attention_mask=torch.ones(1, 20, dtype=torch.long), max_new_tokens=4,
                      do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    answer = out.sequences[0, 20:]
    logprob = torch.stack([s[0].log_softmax(-1)[t] for s, t in zip(out.scores, answer)]).mean().item()
    hit, score = score_answer(lm, prompt, answer, "cpu")
    assert hit and score == pytest.approx(logprob, abs=1e-5)
    wrong = answer.clone()
    wrong[-1] = (wrong[-1] + 1) % 64
    assert not score_answer(lm, prompt, wrong, "cpu")[0]


def test_recall_suite_grid(tokenizer):
    lm = tiny_lm("softmax", max_positions=128, vocab=len(tokenizer))
    val = Split(torch.randint(1, 300, (8, 32), generator=torch.Generator().manual_seed(0)))
    report = passkey_recall(lm, tokenizer, val, [64, 128, 256], [0.0, 1.0], 2, 0, "cpu")
    assert report["contexts"] == [64, 128] and "exceed max_position_embeddings=128" in report["skipped"]["256"]
    assert len(report["acc"]) == 2 and all(len(row) == 2 for row in report["answer_logprob"])
    scores = Recall().scores(report)
    assert set(scores) == {"recall/acc", "recall/acc@64", "recall/acc@128", "recall/answer_logprob"}
    assert scores["recall/answer_logprob"] < 0


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
    assert report["bands"]["1x"] == pytest.approx(expected[:T].mean().item(), abs=1e-5)  # positions 1..T
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
    assert bands([1.0] * 4 + [3.0] * 4, 4, [1, 2]) == {"1x": 1.0, "2x": 3.0}


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
    assert {"recall/acc", "recall/acc@128", "recall/answer_logprob", "decode/tokens_per_sec@64",
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
