"""eval.py's lm-evaluation-harness path: a saved checkpoint is scored on a local task (a YAML + a jsonl
written here). The harness's log-likelihood of every choice equals the one computed from our model
directly, and the accuracy eval.py reports equals the argmax of those."""
import json

import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT

pytest.importorskip("lm_eval", reason="lm-eval is in requirements-eval.txt")

DOCS = [
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " None", "(("], "answer": 0},
    {"question": "import", "choices": [" os", " 42", " ]"], "answer": 1},
    {"question": "for i in", "choices": [" range(10):", " class", " )"], "answer": 2},
    {"question": "x = [1, 2,", "choices": [" 3]", " def", " import"], "answer": 0},
    {"question": "if x is", "choices": [" None:", " )(", " return"], "answer": 1},
    {"question": "print(", "choices": ["'hello')", " while", " ]]"], "answer": 2},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random DecoderLM + a small byte-level BPE, saved as train.py's final/ export is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from model import DecoderLM, LMConfig

    folder = tmp_path_factory.mktemp("ckpt") / "final"
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([d["question"] + c for d in DOCS for c in d["choices"]] * 5, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    torch.manual_seed(0)
    model = DecoderLM(LMConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               mixer=["gdn", "softmax"], max_position_embeddings=64, eos_token_id=tok.eos_token_id))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    # what eval.py reads besides the weights: the training config (its data: a local text folder)
    texts = folder.parent / "texts"
    texts.mkdir()
    for i in range(4):
        (texts / f"{i}.txt").write_text("\n".join(d["question"] + d["choices"][d["answer"]] for d in DOCS) * 40)
    train_cfg = {"data": {"name": "local", "path": str(texts), "tokenizer": "bpe", "vocab_size": 300, "text_column": "text",
                          "max_documents": None, "val_fraction": 0.5, "document_mask": True, "num_proc": 1,
                          "bpe_train_bytes": None, "cache_dir": str(folder.parent / "cache"), "cache_shared": False},
                 "trainer": {"seq_len": 32}}
    (folder / "training_config.yaml").write_text(OmegaConf.to_yaml(train_cfg))
    return folder


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "tiny_choice.yaml").write_text(f"""task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'docs.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return folder


def own_log_likelihoods(folder) -> list[list[float]]:
    """log p(choice | question) of every choice, from our model directly, as the harness defines it: the
    continuation's tokens are those of tokenize(question + choice) after the first len(tokenize(question)),
    read after tokenize(question) (where the two tokenizations merge across the boundary, as "(" + "'"
    does here, this is not tokenize(question + choice))."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import model  # noqa: F401

    lm, tok = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    out = []
    for d in DOCS:
        ctx = tok(d["question"], add_special_tokens=False)["input_ids"]
        scores = []
        for choice in d["choices"]:
            ids = ctx + tok(d["question"] + choice, add_special_tokens=False)["input_ids"][len(ctx):]
            with torch.no_grad():
                logp = lm(input_ids=torch.tensor([ids])).logits[0].double().log_softmax(-1)
            scores.append(sum(logp[t - 1, ids[t]].item() for t in range(len(ctx), len(ids))))
        out.append(scores)
    return out


def test_harness_log_likelihood_of_every_choice_is_ours(checkpoint):
    from lm_eval.api.instance import Instance

    from runs.checkpoint import load_lm
    from evaluation.harness import harness_model

    wrapped = harness_model(load_lm(checkpoint, dtype=torch.float32).eval(), checkpoint, "cpu", batch_size=4)
    requests = [Instance(request_type="loglikelihood", doc=d, arguments=(d["question"], c), idx=i)
                for d in DOCS for i, c in enumerate(d["choices"])]
    theirs = [ll for ll, _ in wrapped.loglikelihood(requests)]
    ours = [ll for scores in own_log_likelihoods(checkpoint) for ll in scores]
    assert theirs == pytest.approx(ours, abs=1e-4)
    assert len(set(round(x, 3) for x in ours)) == len(ours)  # distinct values: a permutation would be caught


@pytest.mark.slow
def test_eval_py_reports_the_harness_accuracy(checkpoint, task_dir, tmp_path, capsys):
    import eval as eval_py

    cfg = OmegaConf.load(ROOT / "configs" / "eval.yaml")
    cfg.merge_with({"checkpoint": str(checkpoint.parent), "tasks": ["tiny_choice"], "include_path": str(task_dir),
                    "lm_eval_batch_size": 4, "device": "cpu", "batches": 0, "sample_tokens": 0, "out_dir": str(tmp_path)})
    report = eval_py.evaluate_checkpoint(cfg)  # a run dir works too: its final/ is used
    expected = sum(max(range(3), key=s.__getitem__) == d["answer"]
                   for s, d in zip(own_log_likelihoods(checkpoint), DOCS)) / len(DOCS)
    assert report["scores"]["lm_eval/tiny_choice/acc"] == pytest.approx(expected)
    assert json.loads((tmp_path / "eval.json").read_text())["lm_eval"]["tiny_choice"]["acc"] == pytest.approx(expected)
    assert "lm_eval/tiny_choice/acc" in capsys.readouterr().out


def test_tokenizerless_checkpoint_fails_clearly(checkpoint, tmp_path):
    from evaluation.harness import harness_model

    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        harness_model(None, bare, "cpu")


def test_harness_generation_and_log_likelihood_at_batch_8_equal_batch_1(checkpoint):
    """Prompts of different lengths in one batch (the harness pads generation prompts on the left, scoring
    requests on the right): generate_until's texts and the log-likelihoods at batch size 8 are batch size 1's."""
    from lm_eval.api.instance import Instance

    from evaluation.harness import harness_model
    from runs.checkpoint import load_lm

    model = load_lm(checkpoint, dtype=torch.float32).eval()
    until = {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}
    generation = [Instance(request_type="generate_until", doc=d, arguments=(d["question"], until), idx=0) for d in DOCS]
    scoring = [Instance(request_type="loglikelihood", doc=d, arguments=(d["question"], c), idx=i)
               for d in DOCS for i, c in enumerate(d["choices"])]
    padded = []  # whether each forward's attention_mask held a pad
    forward = model.forward
    model.forward = lambda *a, attention_mask=None, **k: (padded.append(attention_mask is not None and
                                                                         not bool(attention_mask.all())),
                                                          forward(*a, attention_mask=attention_mask, **k))[1]
    one, eight = (harness_model(model, checkpoint, "cpu", batch_size=size) for size in (1, 8))
    texts = eight.generate_until(generation)
    assert any(padded), "the batch of prompts was not padded"
    assert texts == one.generate_until(generation) and any(texts)
    assert [ll for ll, _ in eight.loglikelihood(scoring)] == pytest.approx([ll for ll, _ in one.loglikelihood(scoring)],
                                                                           abs=1e-5)
