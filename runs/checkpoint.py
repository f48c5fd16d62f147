"""Reading a run's weights back, for evaluation, analysis, init_from and a linearization's teacher: the model of an HF
dir, a run dir (its final/ export) or a mid-run checkpoint (checkpoints/step_N: config.json + the DCP model state),
and copying the weights whose names and shapes match (writing them, resuming: training/checkpoint.py)."""
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_state_dict

STEP_DIR = re.compile(r"^step_(\d+)$")  # a checkpoint's folder, checkpoints/step_N


def run_dcp(fn, state: dict, folder: Path) -> None:
    """dcp.save or dcp.load; in one process without a process group when there is none (DCP warns
    that it assumes so even when told; here that is the intent)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        fn(state, checkpoint_id=folder, no_dist=not dist.is_initialized())


def weights_dir(path: str | Path) -> Path:
    """An HF dir or a checkpoint dir (has config.json), or a run dir (its final/ export)."""
    path = Path(path)
    for candidate in (path, path / "final"):
        if (candidate / "config.json").exists():
            return candidate
    raise FileNotFoundError(f"{str(path)!r} is neither a model dir, a checkpoint dir nor a run dir with final/config.json")


def load_lm(path: str | Path, dtype: torch.dtype | None = None):
    """The model of an HF dir (from_pretrained), a run dir (its final/) or a mid-run checkpoint
    (checkpoints/step_N: config.json + the DCP model state)."""
    from transformers import AutoModelForCausalLM

    import model  # noqa: F401  (registers LMConfig / DecoderLM with the Auto classes)

    folder = weights_dir(path)
    if not (folder / "state").is_dir():
        with no_progress_bar():  # transformers' per-tensor bar: noise in a run's first lines, and on a one-line error
            return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    from transformers import AutoConfig

    lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    state = {"model": get_model_state_dict(lm)}
    run_dcp(dcp.load, state, folder / "state")
    set_state_dict(lm, [], model_state_dict=state["model"], optim_state_dict={})
    return lm.to(dtype) if dtype is not None else lm


@contextmanager
def no_progress_bar():
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def load_matching_weights(model: torch.nn.Module, source: str | Path | dict) -> dict[str, list[str]]:
    """Copy every weight of `source` (a model's path, or its state dict) whose name and shape match; return
    what was new, unused or mismatched."""
    source = source if isinstance(source, dict) else load_lm(source).state_dict()
    own = model.state_dict()
    loaded = {k: v for k, v in source.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(loaded, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    return {
        "loaded": sorted(loaded),
        "new": sorted(k for k in own if k not in source and k not in tied),
        "unused": sorted(k for k in source if k not in own and k not in tied),
        "shape_mismatch": sorted(k for k in source if k in own and own[k].shape != source[k].shape),
    }
