"""The contract every registered sequence mixer passes, read from the registry (model.registry.MIXERS): a
mixer added as its two files (docs/extending.md) is checked here with no test file edited, alone and in a
hybrid with softmax attention, at its default options:

- cached decoding (a prefill, a chunk, single tokens) equals the full forward, and so does decoding after the
  cache is reordered as beam search does (K/V storage reserved 8 positions at a time, so that both cross its growth);
- a packed row (document positions) equals its documents run alone;
- padded batches (attention_mask, left or right): greedy generate of a left-padded batch equals each prompt alone,
  and a padded forward's real logits, loss and gradients equal its rows' alone;
- init_parameters() reaches every parameter;
- its output leaves through the nn.Linear its `output_projection` names: y = W c (+ b) of that layer's input c;
- one step under bf16 autocast gives finite fp32 gradients to every parameter of the mixer;
- flops_per_token is positive and grows with the context (by more than 10% at 4x the context) exactly where the
  decode cache does;
- the optimizer split: Muon takes the blocks' nn.Linear weights, AdamW the rest, with no decay on 1-d
  tensors, embeddings, A_log, dt_bias or D;
- an HF save / from_pretrained round trip gives the same logits;
- its Options (if any) parse from their defaults and its config file composes with an lr per optimizer;
- the parametrization it declares (if any) is a known one; one that declares none counts as llama under per_mixer;
- it declares what it exchanges under context parallelism (`context_exchange`), which tests/test_context_parallel.py
  then checks against one process, for every registered mixer.

Lengths cross a chunk of 64 (the chunked ops' default) and are not multiples of it."""
import dataclasses
import re

import pytest
import torch

from conftest import ROOT, perturbed, reinitialised_over_nan
from model import DecodeCache, DecoderLM, LMConfig
from model.layers import KVBuffer
from model.registry import MIXERS

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def small_kv_blocks(monkeypatch):
    monkeypatch.setattr(KVBuffer, "BLOCK", 8)

VOCAB = 61
LAYOUTS = [[name] for name in MIXERS.names()] + [[name, "softmax"] for name in MIXERS.names() if name != "softmax"]
# Row 0 starts mid-document (position 3) and holds documents of 4, 1, 7 and 4 tokens; row 1 holds 9 + 7.
POSITIONS = torch.tensor([[3, 4, 5, 6, 0, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3],
                          [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6]])


def lm(layers: list[str], seed: int = 0, perturb: bool = True, **config) -> DecoderLM:
    """A small model of these mixers (dense FFNs), in float64 and, with perturb, moved off its init so that
    every part of each mixer matters (gates at their init can hide a missing term)."""
    torch.manual_seed(seed)
    model = DecoderLM(LMConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=len(layers), num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                               mixer=layers, **config))
    return (perturbed(model) if perturb else model).eval()


def ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layers", LAYOUTS, ids="+".join)
def test_decoding_equals_the_full_forward(layers):
    """A 37-token prefill, a 30-token chunk (across the 64-token chunk boundary), then single tokens."""
    model, x = lm(layers), ids(2, 80)
    with torch.no_grad():
        full = model(x).logits
        cache = DecodeCache(len(layers))
        parts = [model(x[:, :37], past_key_values=cache, use_cache=True).logits,
                 model(x[:, 37:67], past_key_values=cache, use_cache=True).logits]
        parts += [model(x[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(67, 80)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-9)


@pytest.mark.parametrize("layers", LAYOUTS, ids="+".join)
def test_decoding_after_a_beam_reorder_equals_the_full_forward(layers):
    """reorder_cache (generate's beam search, every step) moves each layer's whole state with its row."""
    model, x, new = lm(layers), ids(3, 9), ids(3, 3, seed=2)
    beam = torch.tensor([2, 0, 0])  # row 1 dropped, row 0 duplicated, every row moved
    with torch.no_grad():
        cache = DecodeCache(len(layers))
        model(x, past_key_values=cache, use_cache=True)
        cache.reorder_cache(beam)
        steps = torch.cat([model(new[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(3)], 1)
        full = model(torch.cat([x[beam], new], 1)).logits[:, 9:]
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-9)


@pytest.mark.parametrize("layers", LAYOUTS, ids="+".join)
def test_a_packed_row_equals_its_documents_alone(layers):
    model, x = lm(layers), ids(*POSITIONS.shape)
    with torch.no_grad():
        packed = model(input_ids=x, position_ids=POSITIONS).logits
        unmasked = model(input_ids=x).logits
        for b, row in enumerate(POSITIONS.tolist()):
            starts = [0] + [t for t in range(1, len(row)) if row[t] == 0]
            for start, end in zip(starts, starts[1:] + [len(row)]):  # each at its own positions
                alone = model(input_ids=x[b:b + 1, start:end], position_ids=POSITIONS[b:b + 1, start:end]).logits[0]
                torch.testing.assert_close(packed[b, start:end], alone, rtol=1e-9, atol=1e-9)
    # the masking ran: without it, the tokens after the first restart see the earlier documents
    assert not torch.allclose(packed[:, 5:], unmasked[:, 5:], atol=1e-4)


PROMPTS = [1, 6, 13]  # a prompt shorter than a short conv's window, one with 7 pads, one with none
PAD = VOCAB  # an id no prompt holds: generate infers no mask from it (pads are embedded as token 0)


def padded(x: torch.Tensor, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x[b, :PROMPTS[b]] padded to the longest on `side`, as a tokenizer pads, and their attention_mask."""
    T = max(PROMPTS)
    batch, mask = torch.zeros(len(PROMPTS), T, dtype=torch.long), torch.zeros(len(PROMPTS), T, dtype=torch.long)
    for b, n in enumerate(PROMPTS):
        place = slice(T - n, T) if side == "left" else slice(0, n)
        batch[b, place], mask[b, place] = x[b, :n], 1
    return batch, mask


@pytest.mark.parametrize("layers", LAYOUTS, ids="+".join)
def test_greedy_generate_on_a_left_padded_batch_equals_each_prompt_alone(layers):
    """transformers' generate (cached decoding) of a left-padded batch: each row's tokens and every step's logits
    those of its prompt alone; with the pads unmasked some row's are not (the mask was used)."""
    model, x = lm(layers), ids(len(PROMPTS), max(PROMPTS))
    model.generation_config.eos_token_id = None  # every row runs all its steps
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    batch, mask = padded(x, "left")
    with torch.no_grad():
        out = model.generate(batch, attention_mask=mask, **settings)
        unmasked = torch.stack(model.generate(batch, attention_mask=torch.ones_like(mask), **settings).logits)
        logits = torch.stack(out.logits)  # [steps, B, V]
        for b, n in enumerate(PROMPTS):
            alone = model.generate(x[b:b + 1, :n], attention_mask=torch.ones(1, n, dtype=torch.long), **settings)
            assert out.sequences[b, max(PROMPTS):].tolist() == alone.sequences[0, n:].tolist(), b
            torch.testing.assert_close(logits[:, b], torch.stack(alone.logits)[:, 0], rtol=0, atol=1e-9)
    assert not torch.allclose(unmasked, logits, atol=1e-4)


@pytest.mark.parametrize("layers", LAYOUTS, ids="+".join)
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_gives_each_row_its_logits_and_gradients(layers, side):
    """A padded forward with labels: each row's real logits those of the row alone, the loss the mean over
    every row's targets (no pad predicts or is predicted), so its gradients those of the rows' summed losses
    over their count."""
    model, x = lm(layers), ids(len(PROMPTS), max(PROMPTS))
    batch, mask = padded(x, side)
    out = model(batch, attention_mask=mask, labels=batch)
    out.lm_loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total = 0
    for b, n in enumerate(PROMPTS):
        alone = model(x[b:b + 1, :n], labels=x[b:b + 1, :n])
        real = mask[b].bool()
        torch.testing.assert_close(out.logits[b, real], alone.logits[0], rtol=0, atol=1e-9)
        if n > 1:
            (alone.lm_loss * (n - 1)).backward()
            total += n - 1
    assert grads and grads.keys() == {name for name, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad / total, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("layers", LAYOUTS, ids="+".join)
def test_init_reaches_every_parameter(layers):
    """Every parameter is written by an init (from_pretrained leaves a missing one as it was allocated)."""
    model = reinitialised_over_nan(lm(layers, perturb=False, tie_word_embeddings=False))
    assert [name for name, p in model.named_parameters() if not p.isfinite().all()] == []


@pytest.mark.parametrize("name", MIXERS.names())
def test_the_output_leaves_through_the_named_projection(name):
    """`output_projection` names an nn.Linear of the mixer whose input c (recorded by a hook: the core that
    linearize.transfer_target=mixer_core fits) gives the mixer's output exactly as W c, on packed documents."""
    from model.layers import AuxCollector
    from model.segments import DocumentSegments
    from training.objectives.linearize.losses import mixer_cores

    mixer = lm([name]).layers[0].mixer
    projection = getattr(mixer, mixer.output_projection)
    assert isinstance(projection, torch.nn.Linear)
    x = torch.randn(*POSITIONS.shape, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), mixer_cores([mixer]) as cores:
        y = mixer(x, None, AuxCollector(), DocumentSegments(POSITIONS))
    assert cores[0].shape[-1] == projection.in_features and cores[0].abs().sum() > 0
    torch.testing.assert_close(torch.nn.functional.linear(cores[0], projection.weight, projection.bias), y,
                               rtol=0, atol=0)


@pytest.mark.parametrize("layers", LAYOUTS, ids="+".join)
def test_one_step_under_bf16_autocast(layers):
    """As a GPU run trains (CUDA bf16 autocast; here CPU's), with document positions: bf16 logits, and a
    finite fp32 gradient for every parameter of every mixer."""
    model = lm(layers, perturb=False).train()
    x = ids(*POSITIONS.shape)
    with torch.autocast("cpu", torch.bfloat16):
        out = model(x, labels=x, position_ids=POSITIONS)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
    out.loss.backward()
    mixers = [(n, p) for n, p in model.named_parameters() if ".mixer." in n]
    assert mixers
    for name, p in mixers:
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.isfinite().all(), name


def cache_bytes(model: DecoderLM, length: int) -> int:
    with torch.no_grad():
        return model(ids(1, length), use_cache=True).past_key_values.nbytes()


@pytest.mark.parametrize("name", MIXERS.names())
def test_flops_grow_with_the_context_where_the_cache_does(name):
    """A mixer whose decode cache grows with the context (attention's keys and values) costs more per token
    at a longer context; one with a fixed state costs about the same (a chunked form's chunk-to-chunk
    bookkeeping may add a few percent)."""
    model = lm([name], perturb=False)
    mixer = model.layers[0].mixer
    short, long = mixer.flops_per_token(256, "cpu"), mixer.flops_per_token(1024, "cpu")
    assert short > 0
    grows = cache_bytes(model, 96) > cache_bytes(model, 32)
    assert (long > 1.1 * short) == grows, f"{name}: flops {short:g} -> {long:g} at 4x the context, cache grows: {grows}"


@pytest.mark.parametrize("layers", LAYOUTS, ids="+".join)
def test_the_optimizer_split(layers):
    """optimizer=muon: Muon takes exactly the nn.Linear weights inside the blocks; AdamW the rest, decaying
    none of the 1-d tensors, the embedding, A_log, dt_bias or D."""
    from omegaconf import OmegaConf

    from runs.config import CONFIG_DIR
    from training.optim import NO_DECAY_NAMES, build_optimizer

    model = lm(layers, perturb=False)
    muon, adamw = build_optimizer(model, OmegaConf.load(CONFIG_DIR / "optimizer" / "muon.yaml"), lr=1e-3).parts
    name_of = {id(p): n for n, p in model.named_parameters()}
    linear = {f"{m}.weight" for m, module in model.named_modules()
              if m.startswith("layers.") and isinstance(module, torch.nn.Linear)}
    to_muon = {name_of[id(p)] for g in muon.param_groups for p in g["params"]}
    to_adamw = {name_of[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert to_muon == linear and to_muon.isdisjoint(to_adamw) and to_muon | to_adamw == set(name_of.values())
    params = dict(model.named_parameters())
    decayed = {name_of[id(p)] for g in adamw.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert all(params[n].ndim >= 2 and "embed_tokens" not in n and n.rsplit(".", 1)[-1] not in NO_DECAY_NAMES
               for n in decayed), decayed
    assert not any(n.rsplit(".", 1)[-1] in NO_DECAY_NAMES for n in to_muon)


@pytest.mark.parametrize("layers", LAYOUTS, ids="+".join)
def test_hf_round_trip_gives_the_same_logits(layers, tmp_path):
    model, x = lm(layers, perturb=False), ids(2, 20)
    with torch.no_grad():  # off its init, so that a weight left at its init would show
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    loaded = DecoderLM.from_pretrained(tmp_path).eval()
    assert loaded.config.layer_mixers == layers
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)


@pytest.mark.parametrize("name", MIXERS.names())
def test_options_and_config(name):
    """Its Options parse from their defaults; configs/mixer/<name>.yaml composes, names it, and gives an lr for
    every optimizer (trainer.lr reads it)."""
    from hydra import compose, initialize_config_dir

    from model.options import parse_options
    from runs.config import CONFIG_DIR, group_choices, register_hydra

    options = getattr(MIXERS.get(name), "Options", None)
    if options is not None:
        defaults = {f.name: getattr(options(), f.name) for f in dataclasses.fields(options)}
        assert parse_options(name, options, defaults) == options()
    register_hydra()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", [f"mixer={name}"])
    assert cfg.mixer.name == name and set(cfg.mixer.lr) == set(group_choices("optimizer"))
    assert cfg.trainer.lr == cfg.mixer.lr[cfg.optimizer.name] > 0


@pytest.mark.parametrize("name", MIXERS.names())
def test_declared_parametrization_is_known(name):
    """model.parametrization=per_mixer starts the model as its mixers' declared `parametrization` says."""
    from model.config import PARAMETRIZATIONS

    declared = getattr(MIXERS.get(name), "parametrization", None)
    assert declared is None or declared in PARAMETRIZATIONS, \
        f"{name} declares parametrization={declared!r}; known: {', '.join(PARAMETRIZATIONS)}"


def test_per_mixer_takes_the_default_for_a_mixer_that_declares_no_parametrization(monkeypatch):
    from model.config import PARAMETRIZATIONS, UNDECLARED_PARAMETRIZATION

    config = LMConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, mixer="mamba2", parametrization="per_mixer")
    assert config.parametrization_rule() == PARAMETRIZATIONS["mamba2"]
    monkeypatch.delattr(MIXERS.get("mamba2"), "parametrization")
    assert config.parametrization_rule() == PARAMETRIZATIONS[UNDECLARED_PARAMETRIZATION] != PARAMETRIZATIONS["mamba2"]


@pytest.mark.parametrize("name", MIXERS.names())
def test_declares_its_context_parallel_means(name):
    """Under trainer.context_parallel a mixer without `context_exchange` is refused (training/parallel.py); one
    with it is run against one process by tests/test_context_parallel.py, whose cases come from this registry."""
    from cp_worker import cases

    exchange = getattr(MIXERS.get(name), "context_exchange", None)
    assert isinstance(exchange, str) and exchange, name
    assert name in cases()


@pytest.mark.parametrize("name", MIXERS.names())
def test_documented_in_blocks_md(name):
    """docs/blocks.md has its row in the mixer table (`mixer=` name) and in the init table, so the reference of a mixer
    registered later is written down beside the others'."""
    text = (ROOT / "docs" / "blocks.md").read_text()
    assert f"\n| `{name}` |" in text, f"docs/blocks.md's mixer table lacks `{name}`"
    assert re.search(rf"\n\| [^|]*\b{name}\b[^|]* \| ", text.split("| block | follows | init |")[1]), \
        f"docs/blocks.md's init table lacks {name}"
