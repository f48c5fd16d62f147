"""Hydra glue: one-line errors for unknown group choices, the rank-zero run-dir resolver, the blocks' option schemas, cfg -> LMConfig, and the config of a
resumed run (its saved one, with what may change on resume)."""
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

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
    every other problem (training/validation.py block_problems; the router checks its own)."""
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


# What an override given on resume may change: nothing that changes the model, the data order or the
# optimizer (a key, or a prefix ending in "." or "_"). The process layout may change (the global batch
# is trainer.batch_size whatever the processes, accumulation, expert or context parallelism).
RESUMABLE = ("trainer.max_steps", "trainer.grad_accum", "trainer.expert_parallel", "trainer.context_parallel", "trainer.log_every", "trainer.eval_every", "trainer.eval_batches", "trainer.ckpt_every",
             "trainer.keep_checkpoints", "trainer.sample_", "trainer.compile", "logger.", "data.num_proc",
             "data.cache_dir", "data.cache_shared", "run_dir", "resume")


def resumable(key: str) -> bool:
    return any(key == r or (r[-1] in "._" and key.startswith(r)) for r in RESUMABLE)


def saved_config_path(resume: str, run_dir: str | None) -> Path | None:
    """The config a resumed run was saved with: <run_dir>/config.yaml for resume=auto, a checkpoint's
    training_config.yaml, or a run dir's config.yaml; None if there is none (a new run)."""
    where = Path(run_dir) if resume == "auto" else Path(resume)
    return next((p for p in (where / "training_config.yaml", where / "config.yaml") if p.exists()), None)


def config_for_resume(cfg, saved, overrides: list[str], saved_path: Path):
    """The saved config of the run being resumed, with those of this command's overrides that may
    change on resume (RESUMABLE) applied. An override that would change anything else is a one-line
    error naming the key, its saved and its new value. A value that differs only because a default
    changed since the run started keeps its saved value; a resumable key the run's config predates takes
    this config's value (e.g. trainer.context_parallel, 1 by default)."""
    from omegaconf import OmegaConf

    from training.validation import leaves

    given = set()
    for arg in overrides:
        key = arg.lstrip("+~").partition("=")[0]
        if not key.startswith("hydra."):
            given.add(key)
    if "experiment" in given:  # an experiment sets keys anywhere: it is given, or it is the same one
        given.add("experiment_name")
    new = leaves(OmegaConf.to_container(cfg, resolve=True))
    old = leaves(OmegaConf.to_container(saved, resolve=True))
    merged = OmegaConf.create(OmegaConf.to_container(saved, resolve=True))
    missing = object()
    for key in sorted(new.keys() | old.keys(), key=lambda k: (not k.endswith(".name"), k)):  # mixer.name first
        before, after = old.get(key, missing), new.get(key, missing)
        if before == after:
            continue
        touched = any(key == g or key.startswith((g + ".", g + "[")) for g in given)
        if not touched and not (before is missing and resumable(key)):  # a layout key newer than the run: its default
            continue
        if not resumable(key):
            shown = lambda v: "(absent)" if v is missing else repr(v)  # noqa: E731
            raise ValueError(f"resume: {key} was {shown(before)} in {saved_path}, the command gives {shown(after)}; on "
                             f"resume only trainer.max_steps, the log/eval/checkpoint cadences, sampling, trainer.compile, the "
                             f"process layout, logger.* and data caching may change (start a new run_dir to change the rest)")
        if after is missing:  # e.g. logger=none drops logger.project
            parent, _, leaf = key.rpartition(".")
            OmegaConf.select(merged, parent).pop(leaf, None)
        else:
            OmegaConf.update(merged, key, after, force_add=True)
    return merged
