"""scripts/run_lm_eval.py: a saved checkpoint loads through AutoModelForCausalLM and lm-evaluation-harness
scores it on a local task (a YAML + a jsonl written here); the harness's accuracy equals the one from
our own log-likelihoods."""
import json

import pytest
import torch

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
                               attention=["gdn", "softmax"], max_position_embeddings=64, eos_token_id=tok.eos_token_id))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
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


def own_accuracy(folder) -> float:
    """argmax over choices of log p(choice | question), computed with our model directly; the
    continuation's tokens are those of tokenize(question + choice) after tokenize(question)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import model  # noqa: F401

    lm, tok = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    correct = 0
    for d in DOCS:
        ctx = tok(d["question"], add_special_tokens=False)["input_ids"]
        scores = []
        for choice in d["choices"]:
            whole = tok(d["question"] + choice, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logp = lm(input_ids=torch.tensor([whole])).logits[0].log_softmax(-1)
            scores.append(sum(logp[t - 1, whole[t]].item() for t in range(len(ctx), len(whole))))
        correct += max(range(len(scores)), key=scores.__getitem__) == d["answer"]
    return correct / len(DOCS)


def test_lm_eval_on_local_task(checkpoint, task_dir, tmp_path, capsys):
    from scripts import run_lm_eval as script

    out = tmp_path / "results.json"
    # A run dir works too: its final/ is used. Batch size 4 (loglikelihood batches carry no padding mask).
    assert script.main([str(checkpoint.parent), "--tasks", "tiny_choice", "--include-path", str(task_dir),
                        "--batch-size", "4", "--device", "cpu", "--out", str(out)]) == 0
    acc = json.loads(out.read_text())["results"]["tiny_choice"]["acc,none"]
    assert acc == pytest.approx(own_accuracy(checkpoint))
    assert "tiny_choice" in capsys.readouterr().out


def test_tokenizerless_checkpoint_fails_clearly(checkpoint, task_dir, tmp_path):
    from scripts import run_lm_eval as script

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((checkpoint / f).read_bytes())
    with pytest.raises(SystemExit, match="has no tokenizer"):
        script.main([str(bare), "--tasks", "tiny_choice", "--include-path", str(task_dir)])
