"""Hydra glue: one-line errors for unknown group choices, the rank-zero run-dir resolver, and
cfg -> LMConfig."""
import os
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
GROUPS = ("model", "attention", "ffn", "optimizer", "data", "logger", "experiment")


def group_choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def check_group_overrides(argv: list[str]) -> None:
    """Fail at once, in one line, on `attention=nope` (Hydra's own message spans many lines)."""
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or key not in GROUPS or value in ("null", ""):
            continue
        for choice in value.split(","):  # sweeps: attention=softmax,gdn
            if choice not in group_choices(key):
                sys.exit(f"error: unknown {key} {choice!r}; valid: {', '.join(group_choices(key))}")


def rank_zero_dir(path: str) -> str:
    """Hydra's run dir for the main process; other ranks of `accelerate launch` get a throwaway dir
    (train.py broadcasts the main process's dir, so every rank shares one run directory)."""
    rank = int(os.environ.get("RANK", "0"))
    return path if rank == 0 else tempfile.mkdtemp(prefix=f"swaplm-rank{rank}-")


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("rank_zero_dir"):
        OmegaConf.register_new_resolver("rank_zero_dir", rank_zero_dir)


def lm_config(cfg, vocab_size: int, eos_token_id: int | None):
    """LMConfig from cfg.model + cfg.attention + cfg.ffn (a per-layer list in cfg.model overrides
    the group's single name; the group's options apply to its kind)."""
    from model import LMConfig

    m = OmegaConf.to_container(cfg.model, resolve=True)
    m.pop("size")
    attention = m.pop("attention") or cfg.attention.name
    ffn = m.pop("ffn") or cfg.ffn.name
    return LMConfig(
        vocab_size=vocab_size, attention=attention, ffn=ffn, eos_token_id=eos_token_id,
        bos_token_id=eos_token_id,
        mixer_options={cfg.attention.name: OmegaConf.to_container(cfg.attention.options, resolve=True)},
        ffn_options={cfg.ffn.name: OmegaConf.to_container(cfg.ffn.options, resolve=True)},
        **m,
    )
