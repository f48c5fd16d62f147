"""Every config group composes with the defaults, every mixer x ffn choice builds a model that runs
forward/backward, the YAML option sections against the blocks' Options dataclasses, and option errors."""
import dataclasses

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from runs.config import CONFIG_DIR, group_choices, lm_config, register_hydra

register_hydra()


def compose_train(*overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize("group", ["model", "mixer", "ffn", "optimizer", "data", "logger", "experiment"])
def test_every_choice_composes(group):
    for choice in group_choices(group):
        cfg = compose_train(f"{group}={choice}")
        assert cfg.trainer.max_steps > 0
        if group in ("mixer", "ffn", "optimizer"):
            assert cfg[group].name == choice


@pytest.mark.parametrize("mixer", group_choices("mixer"))
@pytest.mark.parametrize("ffn", group_choices("ffn"))
def test_every_block_pair_builds_and_trains_one_step(mixer, ffn, monkeypatch):
    """Every parameter of every block gets a finite, non-zero gradient, and the configured optimizer's
    step moves every parameter and lowers the loss on the batch; DSA runs with top-k below the length,
    through its sparse kernels (the cost model would pick the masked path at this length)."""
    import model.ops.sparse_attention.attention as sa
    from model import DecoderLM
    from training.optim import build_optimizer

    cfg = compose_train(f"mixer={mixer}", f"ffn={ffn}", "model.hidden_size=64", "model.num_hidden_layers=2",
                        "model.num_attention_heads=2", "model.num_key_value_heads=2", "model.intermediate_size=128",
                        *(["mixer.options.topk=8"] if mixer == "dsa" else []))
    ran = []
    monkeypatch.setattr(sa, "attention_path", lambda *args: "sparse")
    sparse_kernel = sa.sparse_attention_with_probs
    monkeypatch.setattr(sa, "sparse_attention_with_probs", lambda q, k, v, sel, *a: ran.append(sel.indices) or
                        sparse_kernel(q, k, v, sel, *a))
    torch.manual_seed(0)
    m = DecoderLM(lm_config(cfg, vocab_size=97, eos_token_id=0))
    x = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    out = m(input_ids=x, labels=x)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    if mixer == "dsa":  # every layer's attention over 8 of up to 40 keys
        assert len(ran) == 2 and all(idx.shape == (2, 40, 8) for idx in ran)
    else:
        assert not ran
    for name, p in m.named_parameters():  # every block's every parameter (the DSA indexer's from its KL)
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    build_optimizer(m, cfg.optimizer, cfg.trainer.lr).step()
    assert [n for n, p in m.named_parameters() if torch.equal(p, before[n])] == []
    with torch.no_grad():
        assert m(input_ids=x, labels=x).loss < out.loss
    assert m.flops_per_token(40, "cpu") > 0


@pytest.mark.parametrize("group", ["mixer", "ffn"])
def test_yaml_options_are_fields_that_differ_from_the_defaults(group):
    """configs/<group>/<name>.yaml per registered block loads its schema as `options`: a block with an Options
    dataclass that dataclass, and the YAML's own option values (if any) are fields of it that differ from its
    defaults (a default lives in the dataclass only); a block without one an empty node, and no options.
    The composed options are the defaults with the YAML's values over them."""
    from model import FFNS, MIXERS

    registry = MIXERS if group == "mixer" else FFNS
    assert group_choices(group) == registry.names()
    with_options = 0
    for name in registry.names():
        raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / group / f"{name}.yaml"))
        given = raw.get("options") or {}
        options_class = getattr(registry.get(name), "Options", None)
        composed = OmegaConf.to_container(compose_train(f"{group}={name}")[group].options)
        assert f"/{group}_options/{name}@options" in raw["defaults"], name  # its schema, empty without options
        if options_class is None:
            assert given == {} and composed == {}, name
            continue
        with_options += 1
        defaults = dataclasses.asdict(options_class())
        for key, value in given.items():
            assert key in defaults, f"configs/{group}/{name}.yaml: {key} is not a field of {options_class.__name__}"
            assert value != defaults[key], f"configs/{group}/{name}.yaml: {key}={value!r} repeats the default"
        assert composed == {**defaults, **given}, name
    assert with_options >= (5 if group == "mixer" else 1)  # gdn, derived_gdn, mamba2, linear, dsa; moe


@pytest.mark.parametrize("kind,name,options,message", [
    ("mixer", "gdn", {"chunk_size": 0}, "gdn chunk_size=0; valid: an integer >= 1"),
    ("mixer", "gdn", {"head_dim": 2.5}, "gdn head_dim=2.5; valid: an integer >= 1 or null"),
    ("mixer", "derived_gdn", {"clamp_ktil": 1}, "derived_gdn clamp_ktil=1; valid: true or false"),
    ("mixer", "mamba2", {"expand": True}, "mamba2 expand=True; valid: an integer >= 1"),
    ("mixer", "dsa", {"stage": "dense"}, "unknown dsa stage 'dense'; valid: warmup, sparse"),
    ("mixer", "linear", {"feature_map": "relu"}, "unknown linear feature_map 'relu'; valid: identity, elu1"),
    ("mixer", "mamba2", {"state_dim": 8}, "unknown mamba2 option(s) ['state_dim']; valid: expand, head_dim, "
                                          "state_size, n_groups, conv_size, chunk_size, allow_neg_eigval"),
    ("ffn", "moe", {"capacity_factor": 0}, "moe capacity_factor=0; valid: a number > 0 or null"),
    ("ffn", "moe", {"balance_loss_coef": -1.0}, "moe balance_loss_coef=-1.0; valid: a number >= 0"),
    ("ffn", "moe", {"router": "expert_choice", "router_options": {"capacity_factor": 0}},
     "expert_choice router capacity_factor=0; valid: a number > 0"),
    ("ffn", "moe", {"router": "hash", "router_options": {"score_func": "sigmoid"}},
     "unknown hash router option(s) ['score_func']; valid: route_scale, norm_topk_prob"),
])
def test_bad_option_is_one_line_naming_block_option_value_and_valid(kind, name, options, message):
    from model import DecoderLM, LMConfig

    config = LMConfig(vocab_size=32, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                      **{kind: name, f"{kind}_options": {name: options}})
    with pytest.raises(ValueError) as e:
        DecoderLM(config)
    assert str(e.value) == message


def test_router_options_on_the_command_line():
    """ffn.options.router_options.<name>=<value> needs no `+` and reaches the chosen router, which alone
    checks its keys (no other router's options in the config)."""
    from model import DecoderLM

    cfg = compose_train("ffn=moe", "ffn.options.router=expert_choice", "ffn.options.router_options.capacity_factor=2")
    assert OmegaConf.to_container(cfg.ffn.options.router_options) == {"capacity_factor": 2}
    router = DecoderLM(lm_config(cfg, vocab_size=97, eos_token_id=0)).layers[0].ffn.router
    assert router.options.capacity_factor == 2 and router.experts_per_token() == 2 * cfg.ffn.options.top_k
    cfg = compose_train("ffn=moe", "ffn.options.router_options.capacity_factor=2")  # topk's options have no such key
    with pytest.raises(ValueError, match=r"^unknown topk router option\(s\) \['capacity_factor'\]; valid: "):
        DecoderLM(lm_config(cfg, vocab_size=97, eos_token_id=0))


def test_trainer_lr_defaults_to_the_mixers_tuned_lr_for_the_optimizer():
    """Each mixer group carries the lr its sweep chose per optimizer; trainer.lr takes it unless set."""
    assert compose_train().trainer.lr == 1e-2  # the default recipe: softmax, Muon
    assert compose_train("optimizer=adamw").trainer.lr == 1e-3
    assert compose_train("mixer=gdn").trainer.lr == 5e-3
    assert compose_train("mixer=gdn", "optimizer=adamw").trainer.lr == 3e-3
    assert compose_train("mixer=gdn", "optimizer=adamw", "trainer.lr=1e-3").trainer.lr == 1e-3
    for path in sorted((CONFIG_DIR / "mixer").glob("*.yaml")):
        for optimizer in ("muon", "adamw"):
            lr = OmegaConf.load(path).lr[optimizer]
            assert compose_train(f"mixer={path.stem}", f"optimizer={optimizer}").trainer.lr == lr > 0
