"""Composing a train.py config: configs/ and its groups, one-line errors for unknown group choices, the rank-zero
run-dir resolver, the blocks' option schemas (register_hydra), the composed config of a command line (compose), its
LMConfig (lm_config) and its model on the meta device (meta_model). Used by train.py, the sweep's checks and the report."""
import os
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf, open_dict

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
GROUPS = ("model", "mixer", "ffn", "optimizer", "data", "logger", "experiment")


def group_choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def check_group_overrides(argv: list[str]) -> None:
    """Fail at once, in one line, on `mixer=nope` (Hydra's own message spans many lines)."""
    for arg in argv:
        group, sep, value = arg.lstrip("+~").partition("=")
        if not sep or group not in GROUPS or value in ("null", ""):
            continue
        for choice in value.split(","):  # sweeps: mixer=softmax,gdn
            if choice not in group_choices(group):
                sys.exit(f"error: unknown {group} {choice!r}; valid: {', '.join(group_choices(group))}")


def rank_zero_dir(path: str | None, fallback: str | None = None) -> str:
    """Hydra's run dir for the main process: path, or fallback where path is null (run_dir's default);
    other ranks of `accelerate launch` get a throwaway dir (train.py broadcasts the main process's dir,
    so every rank shares one run directory)."""
    rank = int(os.environ.get("RANK", "0"))
    return (fallback if path is None else path) if rank == 0 else tempfile.mkdtemp(prefix=f"swaplm-rank{rank}-")


def register_hydra() -> None:
    """The rank_zero_dir resolver, and each block's Options dataclass (an empty node for a block without) as the
    Hydra schema its YAML loads as `options` (ConfigStore groups mixer_options/<name>, ffn_options/<name>): a YAML lists only what
    differs from the defaults, and mixer.options.<name>=<value> overrides any option. The node is not in
    struct mode, so that a misspelt option (and any key of a dict option, the MoE's router_options, given as
    ffn.options.router_options.<name>=<value> without a `+`) reaches the validation, which names it beside
    every other problem (model/options.py block_problems; the router checks its own)."""
    from hydra.core.config_store import ConfigStore

    from model import FFNS, MIXERS

    if not OmegaConf.has_resolver("rank_zero_dir"):
        OmegaConf.register_new_resolver("rank_zero_dir", rank_zero_dir)
    store = ConfigStore.instance()
    for group, registry in (("mixer_options", MIXERS), ("ffn_options", FFNS)):
        for name in registry.names():
            options = getattr(registry.get(name), "Options", None)
            node = OmegaConf.create({}) if options is None else OmegaConf.structured(options)
            OmegaConf.set_struct(node, False)  # an unknown option reaches validation (one line among the others)
            store.store(group=group, name=name, node=node)


def lm_config(cfg, vocab_size: int, eos_token_id: int | None):
    """LMConfig from cfg.model + cfg.mixer + cfg.ffn (a per-layer list in cfg.model overrides
    the group's single name; the group's options apply to its kind)."""
    from model import LMConfig

    m = OmegaConf.to_container(cfg.model, resolve=True)
    m.pop("size")
    mixer = m.pop("mixer") or cfg.mixer.name
    ffn = m.pop("ffn") or cfg.ffn.name
    return LMConfig(
        vocab_size=vocab_size, mixer=mixer, ffn=ffn, eos_token_id=eos_token_id,
        bos_token_id=eos_token_id,
        mixer_options={cfg.mixer.name: OmegaConf.to_container(cfg.mixer.options, resolve=True)},
        ffn_options={cfg.ffn.name: OmegaConf.to_container(cfg.ffn.options, resolve=True)},
        **m,
    )


def override_key(arg: str) -> str:
    """The key a command-line override sets: '++logger.group=g' -> 'logger.group', '~trainer.x' -> 'trainer.x'."""
    return arg.lstrip("+~").partition("=")[0]


def compose(overrides: list[str], hydra: bool = False):
    """The train.py config of these overrides (hydra.* ones dropped; with hydra=True, Hydra's own node
    too), without running anything."""
    from hydra import compose as hydra_compose, initialize_config_dir

    register_hydra()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose("train", [o for o in overrides if not override_key(o).startswith("hydra.")],
                             return_hydra_config=hydra)


def meta_model(cfg, intermediate_size: int | None = None):
    """The DecoderLM of the config on the meta device (no memory, no init); building it checks the block
    options. The vocabulary is data.vocab_size (8192 if the data has none): the data's own may differ."""
    import torch

    from model import DecoderLM

    if intermediate_size is not None:
        with open_dict(cfg):
            cfg.model.intermediate_size = intermediate_size
    with torch.device("meta"):
        return DecoderLM(lm_config(cfg, cfg.data.get("vocab_size") or 8192, None))
