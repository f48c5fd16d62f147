"""Every config group composes with the defaults, and every attention x ffn choice builds a model
that runs forward/backward."""
import pytest
import torch
from hydra import compose, initialize_config_dir

from training.config import CONFIG_DIR, group_choices, lm_config, register_resolvers

register_resolvers()


def compose_train(*overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize("group", ["model", "attention", "ffn", "optimizer", "data", "logger", "experiment"])
def test_every_choice_composes(group):
    for choice in group_choices(group):
        cfg = compose_train(f"{group}={choice}")
        assert cfg.trainer.max_steps > 0
        if group in ("attention", "ffn", "optimizer"):
            assert cfg[group].name == choice


@pytest.mark.parametrize("attention", group_choices("attention"))
@pytest.mark.parametrize("ffn", group_choices("ffn"))
def test_every_block_pair_builds_and_trains_one_step(attention, ffn):
    from model import DecoderLM

    cfg = compose_train(f"attention={attention}", f"ffn={ffn}", "model.hidden_size=64", "model.num_hidden_layers=2",
                        "model.num_attention_heads=2", "model.num_key_value_heads=2", "model.intermediate_size=128")
    torch.manual_seed(0)
    m = DecoderLM(lm_config(cfg, vocab_size=97, eos_token_id=0))
    x = torch.randint(0, 97, (2, 40))
    out = m(input_ids=x, labels=x)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None for n, p in m.named_parameters() if p.requires_grad and "indexer" not in n)
    assert m.flops_per_token(40) > 0
