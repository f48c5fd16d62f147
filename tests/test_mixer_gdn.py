"""The gdn and derived_gdn mixers inside a tiny DecoderLM: decoding with the cache reproduces the full
forward, generate works with a cache that does not grow, training learns a task only the mixer can
solve, a softmax checkpoint loads into derived_gdn."""
import math

import pytest
import torch

from conftest import ALTERNATION_ALPHABET, train_on_alternation
from model import DecodeCache, DecoderLM, LMConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes

SCHEDULES = {"gdn": "gdn", "derived_gdn": "derived_gdn", "hybrid": ["gdn", "softmax"],
             "derived_hybrid": ["derived_gdn", "softmax"]}
OPTIONS = {"gdn": {"chunk_size": 8}}


def tiny_model(mixer, seed=0, num_key_value_heads=None, **options) -> DecoderLM:
    torch.manual_seed(seed)
    config = LMConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=num_key_value_heads, max_position_embeddings=128,
                      mixer=mixer, mixer_options={**OPTIONS, **options})
    return DecoderLM(config).eval()


def randomise(model: DecoderLM) -> None:
    """Move decays, norms and (tiny-init) projections off their init so every term matters."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("dt_bias", "norm.weight")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(20)  # logits of order one, so the derived core's delta terms count


def decode_steps(model, ids, prefill):
    cache = DecodeCache(len(model.layers))
    parts = [model(ids[:, :prefill], past_key_values=cache).logits] if prefill else []
    for t in range(prefill, ids.shape[1]):
        parts.append(model(ids[:, t:t + 1], past_key_values=cache).logits)
    return torch.cat(parts, 1)


@pytest.mark.parametrize("schedule, prefill", [("gdn", 0), ("gdn", 11), ("derived_gdn", 0), ("derived_gdn", 11),
                                               ("hybrid", 11), ("derived_hybrid", 11)])
def test_decoding_matches_full_forward(schedule, prefill):
    model = tiny_model(SCHEDULES[schedule])
    randomise(model)
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(decode_steps(model, ids, prefill), model(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("mixer, kv_heads, options", [
    ("gdn", None, {"gdn": {"num_v_heads": 4, "expand_v": 1, "chunk_size": 4}}),
    ("derived_gdn", 1, {"derived_gdn": {"clamp_ktil": False}}),
])
def test_grouped_heads_decode(mixer, kv_heads, options):
    model = tiny_model(mixer, num_key_value_heads=kv_heads, **options)
    randomise(model)
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(decode_steps(model, ids, 5), model(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("schedule", ["gdn", "derived_gdn"])
def test_generate_greedy_with_constant_cache(schedule):
    model = tiny_model(SCHEDULES[schedule])
    randomise(model)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    sizes = {}
    for n in (3, 6):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             return_dict_in_generate=True)
        sizes[n] = out.past_key_values.nbytes()
    assert sizes[3] == sizes[6] > 0
    seq = ids  # greedy tokens equal argmax of full forwards, one token at a time
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out.sequences, seq)


@pytest.mark.parametrize("schedule", [pytest.param("gdn", marks=pytest.mark.slow), "derived_gdn"])
def test_training_learns_what_only_the_mixer_can(schedule):
    """The alternation task: the mixer must carry the previous token (log(16) is the floor without it).
    gdn's short conv is cut to width 1, so only the delta-rule state can carry it (width 4 sees t-1 alone)."""
    options = {"gdn": {**OPTIONS["gdn"], "conv_size": 1}} if schedule == "gdn" else {}
    # without the conv's help the state takes longer to learn it
    loss = train_on_alternation(tiny_model(SCHEDULES[schedule], **options).train(),
                                **({"steps": 200, "lr": 1e-2} if options else {}))
    assert loss < math.log(ALTERNATION_ALPHABET) - 1, loss


def test_gdn_init_options_and_param_names():
    mixer = tiny_model("gdn").layers[0].mixer
    A, dt = mixer.A_log.exp(), torch.nn.functional.softplus(mixer.dt_bias)
    assert ((A >= 0) & (A <= 16)).all() and ((dt >= 1e-3 - 1e-7) & (dt <= 1e-1 + 1e-7)).all()
    names = {n.rsplit(".", 1)[-1] for n, _ in mixer.named_parameters()}
    assert {"A_log", "dt_bias"} <= names  # the trainer exempts these from weight decay by name
    assert mixer.v_proj.out_features == 2 * 64 and mixer.head_dim == 32
    with pytest.raises(ValueError, match="num_v_heads"):
        tiny_model("gdn", gdn={"num_v_heads": 3})
    with pytest.raises(ValueError, match="expand"):
        tiny_model("gdn", gdn={"expand": 2})
    with pytest.raises(ValueError, match="clamp"):
        tiny_model("derived_gdn", derived_gdn={"clamp": True})


def test_flops_are_linear_in_length():
    for name in ("gdn", "derived_gdn"):
        mixer = tiny_model(name).layers[0].mixer
        assert mixer.flops_per_token(1024, "cpu") == mixer.flops_per_token(8192, "cpu") > 0


def test_softmax_checkpoint_loads_into_derived_gdn(tmp_path):
    torch.manual_seed(0)
    soft = DecoderLM(LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2)).eval()
    soft.save_pretrained(tmp_path)
    derived, info = DecoderLM.from_pretrained(tmp_path, mixer="derived_gdn", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    soft_sd, derived_sd = soft.state_dict(), derived.state_dict()
    assert soft_sd.keys() == derived_sd.keys() and all(torch.equal(soft_sd[k], derived_sd[k]) for k in soft_sd)
    # At init q.k ~ 0: softmax attention is the running mean of v, which is the derived core's vbar term.
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(derived.eval()(ids).logits, soft(ids).logits, rtol=0, atol=1e-3)
