"""The mamba2 and linear mixers inside a tiny DecoderLM: decoding with the cache reproduces the full
forward, generate works with a cache that does not grow, training learns a task only the mixer can solve."""
import math

import pytest
import torch
import torch.nn.functional as F

import model.mixers.mamba2 as mamba2_mixer
from conftest import ALTERNATION_ALPHABET, train_on_alternation
from model import DecodeCache, DecoderLM, LMConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes

SCHEDULES = {"mamba2": "mamba2", "linear": "linear", "hybrid": ["mamba2", "softmax"]}
OPTIONS = {"mamba2": {"head_dim": 16, "state_size": 8, "chunk_size": 8}, "linear": {"chunk_size": 8}}


def tiny_model(mixer, seed=0, kv_heads=None, **options) -> DecoderLM:
    torch.manual_seed(seed)
    config = LMConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=kv_heads, max_position_embeddings=128, mixer=mixer,
                      mixer_options={**OPTIONS, **options})
    return DecoderLM(config).eval()


def randomise_decay_params(model: DecoderLM) -> None:
    """Move dt_bias / D / norms off their init so the checks see every term."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("dt_bias", ".D", "norm.weight", "conv.bias")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("prefill", [0, 11])
def test_decoding_matches_full_forward(schedule, prefill):
    model = tiny_model(SCHEDULES[schedule])
    randomise_decay_params(model)
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        cache = DecodeCache(2)
        parts = [model(ids[:, :prefill], past_key_values=cache).logits] if prefill else []
        for t in range(prefill, ids.shape[1]):
            parts.append(model(ids[:, t:t + 1], past_key_values=cache).logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-4)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_generate_greedy_with_constant_cache(schedule):
    model = tiny_model(SCHEDULES[schedule])
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    linear_bytes, softmax_bytes = {}, {}
    for n in (4, 12):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             return_dict_in_generate=True)
        per_layer = out.past_key_values.layer_nbytes()
        # Layer 0 is mamba2 / linear in every schedule; the hybrid's layer 1 is softmax (grows).
        linear_bytes[n] = sum(per_layer if schedule != "hybrid" else per_layer[:1])
        softmax_bytes[n] = sum(per_layer[1:]) if schedule == "hybrid" else 0
    assert linear_bytes[4] == linear_bytes[12] > 0
    if schedule == "hybrid":
        assert softmax_bytes[12] > softmax_bytes[4]
    # Greedy tokens equal argmax of full forwards, one token at a time.
    seq = ids
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out.sequences, seq)


@pytest.mark.parametrize("schedule", [pytest.param("mamba2", marks=pytest.mark.slow), "linear"])  # (a hybrid's softmax could do it alone)
def test_training_learns_what_only_the_mixer_can(schedule):
    """The alternation task: the mixer must carry the previous token (log(16) is the floor without it).
    Mamba2's short conv is cut to width 1, so only the scan's state can carry it (width 4 sees t-1 alone)."""
    options = {"mamba2": {**OPTIONS["mamba2"], "conv_size": 1}} if schedule == "mamba2" else {}
    # without the conv's help the state takes longer to learn it
    loss = train_on_alternation(tiny_model(SCHEDULES[schedule], **options).train(),
                                **({"steps": 200, "lr": 1e-2} if options else {}))
    assert loss < math.log(ALTERNATION_ALPHABET) - 1, loss


@pytest.mark.parametrize("kv_heads,options", [(None, {"feature_map": "identity", "normalize": False, "chunk_size": 4}),
                                               (1, {"chunk_size": 4})])
def test_linear_options_and_gqa_decode(kv_heads, options):
    model = tiny_model("linear", kv_heads=kv_heads, linear=options)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids).logits
        cache = DecodeCache(2)
        steps = torch.cat([model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(9)], 1)
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-4)


def test_linear_bad_options():
    with pytest.raises(ValueError, match="feature_map"):
        tiny_model("linear", linear={"feature_map": "relu"})
    with pytest.raises(ValueError, match="chunk_size"):
        tiny_model("linear", linear={"chunk_size": -1})
    with pytest.raises(ValueError, match="normalize"):
        tiny_model("linear", linear={"feature_map": "identity", "normalize": True})


def test_mamba2_bad_options_and_init():
    with pytest.raises(ValueError, match="state_dim"):
        tiny_model("mamba2", mamba2={"state_dim": 8})
    with pytest.raises(ValueError, match="chunk_size"):
        tiny_model("mamba2", mamba2={"chunk_size": 0})
    with pytest.raises(ValueError, match="n_groups"):
        tiny_model("mamba2", mamba2={"head_dim": 16, "n_groups": 3})
    mixer = tiny_model("mamba2", mamba2={"head_dim": 16, "state_size": 8, "n_groups": 2}).layers[0].mixer
    A = mixer.A_log.exp()
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert ((A >= 1) & (A <= 16)).all() and ((dt >= 1e-3 - 1e-7) & (dt <= 1e-1 + 1e-7)).all()
    assert torch.equal(mixer.D, torch.ones_like(mixer.D))


def test_mamba2_groups_decode():
    model = tiny_model("mamba2", mamba2={"head_dim": 16, "state_size": 8, "n_groups": 2, "chunk_size": 4})
    randomise_decay_params(model)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids).logits
        cache = DecodeCache(2)
        steps = torch.cat([model(ids[:, :3], past_key_values=cache).logits]
                          + [model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(3, 10)], 1)
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-4)


def test_mamba2_negative_eigenvalues_reach_the_scan_and_decode(monkeypatch):
    """allow_neg_eigval: the scan and the decoding step get the option and transitions a_t = 2 exp(dt A) - 1 < 0
    (dt_bias raised so that dt |A| > log 2 for many tokens); decoding (a prefill, a chunk across chunk_size, single
    tokens) equals the full forward in float64; the same weights without the option give other logits."""
    model = tiny_model("mamba2", mamba2={**OPTIONS["mamba2"], "allow_neg_eigval": True}).double()
    randomise_decay_params(model)
    with torch.no_grad():
        for layer in model.layers:
            layer.mixer.dt_bias.add_(1.0)
    seen = {"mamba_chunk_scan": [], "mamba_state_step": []}  # per call: (allow_neg_eigval, a_t)
    for name, calls in seen.items():
        def spied(x, dt, A, *args, original=getattr(mamba2_mixer, name), calls=calls, **kw):
            calls.append((kw.get("allow_neg_eigval"), 2 * torch.exp(F.softplus(dt + kw["dt_bias"]) * A) - 1))
            return original(x, dt, A, *args, **kw)
        monkeypatch.setattr(mamba2_mixer, name, spied)
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        full = model(ids).logits
        cache = DecodeCache(2)
        parts = [model(ids[:, :5], past_key_values=cache).logits, model(ids[:, 5:16], past_key_values=cache).logits]
        parts += [model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(16, 21)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-9)
    for name, calls in seen.items():
        assert calls and all(flag is True for flag, _ in calls), name
        a = torch.cat([a.flatten() for _, a in calls])
        assert (a < 0).any() and (a > 0).any(), name
    plain = tiny_model("mamba2").double()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (plain(ids).logits - full).abs().max() > 1e-2


@pytest.mark.parametrize("n_groups", [1, 2])
def test_mamba2_matches_transformers_mixer(n_groups):
    """Same weights in transformers' Mamba2Mixer (its torch path) give the same output."""
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    model = tiny_model("mamba2", mamba2={"head_dim": 16, "state_size": 8, "n_groups": n_groups, "chunk_size": 8})
    randomise_decay_params(model)
    ours = model.layers[0].mixer
    with torch.no_grad():
        ours.norm.weight.fill_(1.0)  # ours shares the norm weight across groups; theirs is per channel
    hf = Mamba2Mixer(Mamba2Config(hidden_size=64, num_heads=8, head_dim=16, expand=2, state_size=8,
                                  n_groups=n_groups, conv_kernel=4, chunk_size=8, num_hidden_layers=2,
                                  layer_norm_epsilon=model.config.rms_norm_eps), layer_idx=0).eval()
    with torch.no_grad():
        for a, b in [(hf.in_proj.weight, ours.in_proj.weight), (hf.conv1d.weight, ours.conv.conv.weight),
                     (hf.conv1d.bias, ours.conv.conv.bias), (hf.dt_bias, ours.dt_bias), (hf.A_log, ours.A_log),
                     (hf.D, ours.D), (hf.norm.weight, torch.ones(128)), (hf.out_proj.weight, ours.out_proj.weight)]:
            a.copy_(b)
        x = torch.randn(2, 13, 64, generator=torch.Generator().manual_seed(7))
        torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=1e-5)


def test_softmax_checkpoint_loads_into_linear():
    softmax, linear = tiny_model("softmax"), tiny_model("linear", seed=1)
    linear.load_state_dict(softmax.state_dict(), strict=True)
    for a, b in zip(softmax.layers[0].mixer.parameters(), linear.layers[0].mixer.parameters()):
        assert torch.equal(a, b)
