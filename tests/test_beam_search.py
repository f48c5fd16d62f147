"""DecodeCache.reorder_cache, for a model with every registered mixer, one per layer: after a reorder, decoding continues the reordered rows exactly as a full forward of them does,
and generate's beam search (which reorders the cache every step) returns the beams of a beam search
written out here with full forwards and no cache."""
import pytest
import torch

from model import MIXERS, DecodeCache, DecoderLM, LMConfig

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 97


@pytest.fixture(scope="module")
def model() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(LMConfig(vocab_size=VOCAB, mixer=MIXERS.names(), hidden_size=32,
                              num_hidden_layers=len(MIXERS.names()), num_attention_heads=2, num_key_value_heads=2,
                              intermediate_size=64, max_position_embeddings=64, mixer_options={"dsa": {"topk": 4}})).eval()


def test_reorder_then_decode_equals_the_full_forward_of_the_reordered_rows(model):
    g = torch.Generator().manual_seed(1)
    ids, new = torch.randint(0, VOCAB, (3, 7), generator=g), torch.randint(0, VOCAB, (3, 2), generator=g)
    beam_idx = torch.tensor([2, 0, 0])  # row 1 dropped, row 0 duplicated, every row moved
    cache = DecodeCache(len(model.layers))
    with torch.no_grad():
        model(ids, past_key_values=cache)
        cache.reorder_cache(beam_idx)
        steps = torch.cat([model(new[:, t:t + 1], past_key_values=cache).logits for t in range(2)], 1)
        full = model(torch.cat([ids[beam_idx], new], 1)).logits[:, 7:]
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-4)  # any layer's state left in place shows here


def reference_beam_search(model, prompt: list[int], beams: int, new_tokens: int) -> list[list[int]]:
    """Keep the `beams` continuations of highest total log-probability, one token at a time, each
    scored by a full forward (no cache); best first."""
    hyps = [(prompt, 0.0)]
    with torch.no_grad():
        for _ in range(new_tokens):
            logp = model(torch.tensor([seq for seq, _ in hyps])).logits[:, -1].double().log_softmax(-1)
            candidates = [(seq + [tok], score + logp[i, tok].item()) for i, (seq, score) in enumerate(hyps)
                          for tok in range(VOCAB)]
            hyps = sorted(candidates, key=lambda c: -c[1])[:beams]
    return [seq for seq, _ in hyps]


def test_generate_beam_search_equals_a_reference_beam_search(model, monkeypatch):
    reorders = []
    reorder = DecodeCache.reorder_cache
    monkeypatch.setattr(DecodeCache, "reorder_cache", lambda self, idx: reorders.append(idx.tolist()) or reorder(self, idx))
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, num_beams=3,
                         num_return_sequences=3, do_sample=False, early_stopping=False, eos_token_id=None,
                         pad_token_id=0, length_penalty=0.0)
    assert out.tolist() == reference_beam_search(model, prompt[0].tolist(), beams=3, new_tokens=6)
    assert len(reorders) >= 5 and any(idx != [0, 1, 2] for idx in reorders), reorders  # beams did swap
