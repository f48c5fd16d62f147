"""Checkpoints: Accelerate save_state (model, optimizer, scheduler, RNG) plus trainer_state.json
(step = data position, since batches are a pure function of the step), written to a temp folder and
renamed, keeping the last N; and loading weights from an HF dir or a run dir (init_from)."""
import json
import re
import shutil
from pathlib import Path

import torch

STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoints(run_dir: Path) -> list[Path]:
    folder = Path(run_dir) / "checkpoints"
    found = [p for p in folder.glob("step_*") if STEP_DIR.match(p.name) and (p / "trainer_state.json").exists()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def save_checkpoint(accelerator, run_dir: Path, state: dict, keep: int) -> Path:
    """Called on every rank (save_state gathers per-rank RNG); only the main process renames/prunes."""
    final = Path(run_dir) / "checkpoints" / f"step_{state['step']:07d}"
    tmp = final.with_name(f".tmp_{final.name}")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    """resume: None | 'auto' (latest in run_dir, None if there is none) | a checkpoint or run dir."""
    if resume is None:
        return None
    if resume == "auto":
        found = checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if (path / "trainer_state.json").exists():
        return path
    found = checkpoints(path) if path.exists() else []
    if not found:
        raise FileNotFoundError(f"resume={resume!r} is neither a checkpoint nor a run dir with checkpoints")
    return found[-1]


def weights_dir(path: str | Path) -> Path:
    """An HF dir (has config.json) or a run dir (its final/ export)."""
    path = Path(path)
    for candidate in (path, path / "final"):
        if (candidate / "config.json").exists():
            return candidate
    raise FileNotFoundError(f"{str(path)!r} is neither an HF model dir nor a run dir with final/config.json")


def load_matching_weights(model: torch.nn.Module, path: str | Path) -> dict[str, list[str]]:
    """Copy every weight whose name and shape match; return what was new, unused or mismatched."""
    from safetensors.torch import load_file

    folder = weights_dir(path)
    source = {}
    for file in sorted(folder.glob("*.safetensors")):
        source.update(load_file(file))
    own = model.state_dict()
    loaded = {k: v for k, v in source.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(loaded, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    return {
        "loaded": sorted(loaded),
        "new": sorted(k for k in own if k not in source and k not in tied),
        "unused": sorted(k for k in source if k not in own),
        "shape_mismatch": sorted(k for k in source if k in own and own[k].shape != source[k].shape),
    }
