"""The sample settings reach transformers' generate: greedy vs sampled, the seed, top-p, and a
repetition penalty that breaks the loop of a model that loops."""
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from model import DecoderLM, LMConfig
from evaluation.samples import sample

WORDS = ["<eos>"] + [f"w{i}" for i in range(63)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm_and_tokenizer():
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<eos>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    torch.manual_seed(0)
    # Untrained, tied embeddings: the current token's own embedding dominates its logits, so greedy
    # decoding repeats one token.
    model = DecoderLM(LMConfig(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=2, intermediate_size=64, eos_token_id=0,
                               initializer_range=0.1, parametrization="tied")).eval()
    return model, tokenizer


def generate(lm_and_tokenizer, seed=0, temperature=0.8, top_p=0.95, repetition_penalty=1.0) -> list[str]:
    model, tokenizer = lm_and_tokenizer
    out = sample(model, tokenizer, "w1 w2 w3", 24, seed, torch.device("cpu"), temperature=temperature, top_p=top_p,
                 repetition_penalty=repetition_penalty)
    assert out["new_tokens"] == 24
    return out["text"].split()[3:]


def test_greedy_sampled_seed_and_top_p(lm_and_tokenizer):
    greedy = generate(lm_and_tokenizer, temperature=0)
    sampled = generate(lm_and_tokenizer, seed=0)
    assert sampled != greedy
    assert generate(lm_and_tokenizer, seed=0) == sampled  # reproducible
    assert generate(lm_and_tokenizer, seed=1) != sampled
    # A nucleus this small keeps only the most likely token: sampling becomes greedy.
    assert generate(lm_and_tokenizer, seed=1, temperature=1.0, top_p=1e-6) == greedy


def test_repetition_penalty_breaks_a_loop(lm_and_tokenizer):
    looping = generate(lm_and_tokenizer, temperature=0)
    assert len(set(looping)) == 1, looping  # the model loops
    assert len(set(generate(lm_and_tokenizer, temperature=0, repetition_penalty=1.3))) > 1
    assert len(set(generate(lm_and_tokenizer, temperature=0, repetition_penalty=3.0))) >= 20
