"""transformers conventions: save/load round trip through the Auto classes, generate with the cache
equals the uncached forward, the max length is enforced."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from model import DecodeCache, DecoderLM, LMConfig


def tiny(**kw):
    return LMConfig(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=96, max_position_embeddings=64, **kw)


def test_save_load_generate_round_trip(tmp_path):
    torch.manual_seed(0)
    m = DecoderLM(tiny(parametrization="tied")).eval()
    m.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "swaplm"
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(m2, DecoderLM) and m2.lm_head.weight is m2.embed_tokens.weight
    x = torch.randint(0, 101, (2, 12))
    assert torch.equal(m(x).logits, m2(x).logits)
    gen = m2.generate(x, max_new_tokens=10, do_sample=False)
    ref = x
    for _ in range(10):  # greedy without a cache
        ref = torch.cat([ref, m2(ref).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(gen, ref)


def test_incremental_decoding_matches_forward():
    torch.manual_seed(0)
    m = DecoderLM(tiny()).eval()
    x = torch.randint(0, 101, (2, 20))
    full = m(x).logits
    cache = DecodeCache(2)
    parts = [m(x[:, :7], past_key_values=cache).logits]  # a prefill, then a chunk, then single tokens
    parts.append(m(x[:, 7:12], past_key_values=cache).logits)
    parts += [m(x[:, t:t + 1], past_key_values=cache).logits for t in range(12, 20)]
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)


def test_untied_and_errors(tmp_path):
    m = DecoderLM(tiny(parametrization="per_mixer"))  # softmax declares llama's: untied
    assert m.config.tie_word_embeddings is False and m.lm_head.weight is not m.embed_tokens.weight
    m.save_pretrained(tmp_path)
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert m2.lm_head.weight is not m2.embed_tokens.weight and torch.equal(m2.lm_head.weight, m.lm_head.weight)
    with pytest.raises(ValueError, match="parametrization='gpt'; valid: per_mixer, llama, fla, tied, mamba2"):
        tiny(parametrization="gpt")
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=64"):
        m(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown mixer 'nope'; valid: "):
        DecoderLM(tiny(mixer="nope"))
    with pytest.raises(ValueError, match="mixer lists 3 layers but num_hidden_layers=2"):
        DecoderLM(tiny(mixer=["softmax"] * 3)).config.layer_mixers


@pytest.mark.parametrize("parametrization, o_std", [("fla", 0.02 / 4), ("llama", 0.02)])
def test_scaled_init(parametrization, o_std):
    """Residual writes at 1/sqrt(2 L) of the block's std where the parametrization rescales (fla), not in Llama's."""
    m = DecoderLM(LMConfig(vocab_size=50, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
                           parametrization=parametrization))
    std_q = m.layers[0].mixer.q_proj.weight.std().item()
    std_o = m.layers[0].mixer.o_proj.weight.std().item()
    assert std_q == pytest.approx(0.02, rel=0.05) and std_o == pytest.approx(o_std, rel=0.05)


def test_config_json_saved_with_attention_still_loads(tmp_path):
    """Before `mixer` had its name, config.json said "attention": such a model loads unchanged."""
    import json

    torch.manual_seed(0)
    m = DecoderLM(tiny(mixer=["gdn", "softmax"], mixer_options={"gdn": {"chunk_size": 8}})).eval()
    m.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["mixer"] == ["gdn", "softmax"] and "attention" not in saved
    saved["attention"] = saved.pop("mixer")
    (tmp_path / "config.json").write_text(json.dumps(saved))
    old = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert old.config.layer_mixers == ["gdn", "softmax"] and old.layers[0].mixer.chunk_size == 8
    x = torch.randint(0, 101, (2, 12))
    assert torch.equal(m(x).logits, old(x).logits)
