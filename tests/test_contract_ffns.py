"""The contract every registered FFN passes, and the MoE under every registered router, read from the
registries (model.registry.FFNS, ROUTERS): an FFN or a router added as its own file is checked here with no
test file edited, at its default options (the MoE at 4 experts, top-2):

- cached decoding (a prefill, a chunk, single tokens) equals the full forward;
- init_parameters() reaches every parameter;
- one step under bf16 autocast gives finite fp32 gradients, the FFN's parameters among them;
- flops_per_token is positive and the same at any context (an FFN sees one token);
- the optimizer split: Muon takes the blocks' nn.Linear weights and stacked expert weights, AdamW the rest,
  decaying no 1-d tensor;
- an HF save / from_pretrained round trip gives the same logits;
- its Options (and the router's) parse from their defaults.

2-process DDP equals 1 process with accumulation for every router in tests/test_moe_routers_ddp.py (one
launch), expert parallelism for every router in tests/test_expert_parallel.py."""
import dataclasses

import pytest
import torch

from conftest import perturbed, reinitialised_over_nan
from model import DecodeCache, DecoderLM, LMConfig
from model.ffn.routers import ROUTERS
from model.registry import FFNS

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 61
BLOCKS = [(name, None) for name in FFNS.names() if name != "moe"] + [("moe", router) for router in ROUTERS.names()]
IDS = [name if router is None else f"moe:{router}" for name, router in BLOCKS]


def lm(ffn: str, router: str | None, perturb: bool = True, **config) -> DecoderLM:
    torch.manual_seed(0)
    options = {"moe": {"router": router, "num_experts": 4, "top_k": 2}} if router else {}
    model = DecoderLM(LMConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128, ffn=ffn,
                               ffn_options=options, **config))
    return (perturbed(model) if perturb else model).eval()


def ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("ffn, router", BLOCKS, ids=IDS)
def test_decoding_equals_the_full_forward(ffn, router):
    model, x = lm(ffn, router), ids(2, 40)
    with torch.no_grad():
        full = model(x).logits
        cache = DecodeCache(2)
        parts = [model(x[:, :17], past_key_values=cache, use_cache=True).logits,
                 model(x[:, 17:30], past_key_values=cache, use_cache=True).logits]
        parts += [model(x[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(30, 40)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-9)


@pytest.mark.parametrize("ffn, router", BLOCKS, ids=IDS)
def test_init_reaches_every_parameter(ffn, router):
    model = reinitialised_over_nan(lm(ffn, router, perturb=False, tie_word_embeddings=False))
    assert [name for name, p in model.named_parameters() if not p.isfinite().all()] == []


@pytest.mark.parametrize("ffn, router", BLOCKS, ids=IDS)
def test_one_step_under_bf16_autocast(ffn, router):
    model, x = lm(ffn, router, perturb=False).train(), ids(2, 24)
    with torch.autocast("cpu", torch.bfloat16):
        out = model(x, labels=x)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any(".ffn." in n for n in grads)
    assert all(g.dtype == torch.float32 and g.isfinite().all() for g in grads.values()), [
        n for n, g in grads.items() if not g.isfinite().all()]


@pytest.mark.parametrize("ffn, router", BLOCKS, ids=IDS)
def test_flops_are_positive_and_per_token(ffn, router):
    block = lm(ffn, router, perturb=False).layers[0].ffn
    assert block.flops_per_token() > 0
    if router is not None:  # the router's own FLOPs are part of the MoE's
        assert block.flops_per_token() >= block.router.flops_per_token() >= 0


@pytest.mark.parametrize("ffn, router", BLOCKS, ids=IDS)
def test_the_optimizer_split(ffn, router):
    from omegaconf import OmegaConf

    from runs.config import CONFIG_DIR
    from training.optim import build_optimizer, muon_split

    model = lm(ffn, router, perturb=False)
    matrices, stacked, rest = (dict(part) for part in muon_split(model))
    linear = {f"{m}.weight" for m, module in model.named_modules()
              if m.startswith("layers.") and isinstance(module, torch.nn.Linear)}
    assert set(matrices) == linear and all(p.ndim == 3 for p in stacked.values())
    muon, adamw = build_optimizer(model, OmegaConf.load(CONFIG_DIR / "optimizer" / "muon.yaml"), lr=1e-3).parts
    name_of = {id(p): n for n, p in model.named_parameters()}
    assert {name_of[id(p)] for g in muon.param_groups for p in g["params"]} == set(matrices) | set(stacked)
    decayed = [name_of[id(p)] for g in adamw.param_groups if g["weight_decay"] > 0 for p in g["params"]]
    assert all(dict(model.named_parameters())[n].ndim >= 2 for n in decayed), decayed


@pytest.mark.parametrize("ffn, router", BLOCKS, ids=IDS)
def test_hf_round_trip_gives_the_same_logits(ffn, router, tmp_path):
    model, x = lm(ffn, router).float(), ids(2, 20)
    model.save_pretrained(tmp_path)
    loaded = DecoderLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)


@pytest.mark.parametrize("ffn, router", BLOCKS, ids=IDS)
def test_options_parse_from_their_defaults(ffn, router):
    from model.options import parse_options

    for name, options in ((ffn, getattr(FFNS.get(ffn), "Options", None)),
                          (router, getattr(ROUTERS.get(router), "Options", None) if router else None)):
        if options is not None:
            defaults = {f.name: getattr(options(), f.name) for f in dataclasses.fields(options)}
            assert parse_options(name, options, defaults) == options()


@pytest.mark.parametrize("ffn, router", BLOCKS, ids=IDS)
def test_pads_are_left_out_of_routing_and_its_statistics(ffn, router):
    """Three rows of 9 real tokens padded to 12 (on the left, on the right, on both sides), in training: their
    real logits, the loss and every aux loss and metric (the MoE's balance losses and load telemetry) are those
    of the unpadded [3, 9] batch: no pad takes a route, a slot of capacity or a share of the statistics."""
    model, x = lm(ffn, router).train(), ids(3, 9)
    batch, mask = torch.zeros(3, 12, dtype=torch.long), torch.zeros(3, 12, dtype=torch.long)
    for row, start in enumerate((3, 0, 2)):
        batch[row, start:start + 9], mask[row, start:start + 9] = x[row], 1
    torch.manual_seed(0)  # a router that samples draws the same for the same tokens
    padded = model(batch, attention_mask=mask, labels=batch)
    torch.manual_seed(0)
    plain = model(x, labels=x)
    torch.testing.assert_close(padded.logits[mask.bool()], plain.logits.flatten(0, 1), rtol=0, atol=1e-9)
    torch.testing.assert_close(padded.loss, plain.loss, rtol=0, atol=1e-9)
    assert padded.aux_metrics.keys() == plain.aux_metrics.keys()
    for name, value in plain.aux_metrics.items():
        torch.testing.assert_close(padded.aux_metrics[name], value, rtol=0, atol=1e-6, msg=name)
