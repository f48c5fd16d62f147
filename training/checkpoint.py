"""Checkpoints, the final export and resuming (reading weights back elsewhere: runs/checkpoint.py).

A checkpoint `checkpoints/step_N/` holds
- `state/`: model and optimizer state through torch.distributed.checkpoint (DCP): every rank writes
  its own shard under FSDP, rank 0 writes the replicated tensors under DDP or one process. DCP
  reshards on load, so a run checkpointed with P processes resumes with any other count (the global
  batch is a pure function of the step, so the data position is the step: trainer_state.json);
- `scheduler.pt`, `trainer_state.json` (step, tokens seen, elapsed time, processes);
- `config.json`, `training_config.yaml` and the tokenizer, so that evaluation scripts can load it
  like an exported model (runs/checkpoint.py `load_lm`);
- `manifest.json`, written last: the size and SHA-256 of every other file. `resume=auto` verifies
  the latest checkpoint against it and falls back to the previous good one.
Each is written to a temp folder and renamed. The training step draws no random numbers (batches
come from the step, the model has no dropout), so no RNG state is saved.

We use DCP directly rather than Accelerate's save_state because it is one code path for one
process, DDP and FSDP2 alike (Accelerate's sharded path needs its FSDP plugin, which it ignores on
CPU), and it can be tested on CPU with torch's fully_shard over gloo.
"""
import hashlib
import json
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from common.files import rename_into_place, written_then_renamed
from runs.checkpoint import STEP_DIR, run_dcp

MANIFEST = "manifest.json"


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class StopFlag:
    """SIGINT/SIGTERM set a flag; the loop checkpoints and exits after the current step."""

    def __init__(self):
        self.signal = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)

    def handle(self, signum, frame):
        self.signal = signal.Signals(signum).name


# writing --------------------------------------------------------------------------------------
def write_model_files(folder: Path, model, tokenizer, training_config: str) -> None:
    """What from_pretrained-style loaders need besides the weights: config, tokenizer, run config."""
    model.config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    (folder / "training_config.yaml").write_text(training_config)


def file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": file_digest(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def save_checkpoint(run_dir: Path, model, optimizers: list, scheduler, state: dict, keep: int,
                    tokenizer=None, training_config: str = "", expert_mesh=None) -> Path:
    """Called on every rank (each writes its DCP shard); the main process writes the small files,
    the manifest, renames and prunes to the last `keep`. With expert parallelism (expert_mesh), the
    expert shards are saved as the DTensors they are (training/parallel.py)."""
    final = Path(run_dir) / "checkpoints" / f"step_{state['step']:07d}"
    tmp = final.with_name(f".tmp_{final.name}")  # one name for every rank: each writes its DCP shard there
    if is_main() and tmp.exists():
        shutil.rmtree(tmp)
    barrier()
    model_state, optim_state = get_state_dict(model, optimizers)
    saved = with_expert_shards({"model": model_state, "optim": optim_state}, model, expert_mesh)
    run_dcp(dcp.save, saved, tmp / "state")
    if is_main():
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        write_model_files(tmp, model, tokenizer, training_config)
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        write_manifest(tmp)
        rename_into_place(tmp, final)
        for old in checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    barrier()
    return final


def load_checkpoint(folder: Path, model, optimizers: list, scheduler, expert_mesh=None) -> dict:
    """Load model, optimizer and scheduler state in place (resharding to this run's layout, expert
    parallelism included); returns trainer_state.json. The optimizer state loads for the parameters that
    require gradients (torch's get_state_dict fills an empty state for those), as when it was saved."""
    model_state, optim_state = get_state_dict(model, optimizers)
    state = with_expert_shards({"model": model_state, "optim": optim_state}, model, expert_mesh)
    run_dcp(dcp.load, state, folder / "state")
    if expert_mesh is not None:
        from training.parallel import as_local

        state = as_local(state)
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=False))
    return trainer_state(folder)


def trainer_state(folder: Path) -> dict:
    """A checkpoint's trainer_state.json: step, tokens seen, elapsed time, processes."""
    return json.loads((Path(folder) / "trainer_state.json").read_text())


def with_expert_shards(state: dict, model, expert_mesh) -> dict:
    """The state with each expert shard as a DTensor on the expert mesh (as is without one)."""
    if expert_mesh is None:
        return state
    from training.parallel import as_dtensors

    return as_dtensors(state, model, expert_mesh)


def export_final(model, tokenizer, training_config: str, run_dir: Path, expert_mesh=None) -> Path:
    """<run_dir>/final: an HF model dir (safetensors + config + tokenizer + the training config).
    Every rank must call it: under FSDP the full state dict is gathered from all shards (to rank 0's
    CPU), with expert parallelism every expert from its rank; only the main process writes, to a temp
    dir that is then renamed."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if expert_mesh is not None:
        from training.parallel import full_experts

        full = full_experts(full, model, expert_mesh)
    final = Path(run_dir) / "final"
    if is_main():
        with written_then_renamed(final, tmp=Path(run_dir) / ".tmp_final") as tmp:
            model.save_pretrained(tmp, state_dict=full, is_main_process=True)
            write_model_files(tmp, model, tokenizer, training_config)
    barrier()
    return final


# finding and verifying -------------------------------------------------------------------------
def checkpoints(run_dir: Path) -> list[Path]:
    folder = Path(run_dir) / "checkpoints"
    found = [p for p in folder.glob("step_*") if STEP_DIR.match(p.name) and (p / "trainer_state.json").exists()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def checkpoint_problem(folder: Path) -> str | None:
    """None if every file the manifest lists is there with its size and checksum; else what is wrong."""
    manifest = folder / MANIFEST
    if not manifest.exists():
        return f"{manifest} is missing"
    for name, expected in json.loads(manifest.read_text()).items():
        path = folder / name
        if not path.exists():
            return f"{path} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, expected {expected['bytes']} (truncated?)"
        if file_digest(path) != expected["sha256"]:
            return f"{path} does not match its checksum (corrupt)"
    return None


def resolve_resume(resume: str | None, run_dir: Path, warn=print) -> Path | None:
    """resume: None | 'auto' (the latest good checkpoint in run_dir; None if there is none) | a
    checkpoint dir or a run dir (its latest good checkpoint). Bad checkpoints are reported with the
    file at fault and skipped; if checkpoints exist but none is good, that is an error."""
    if resume is None:
        return None
    if resume == "auto":
        candidates = checkpoints(run_dir)
        if not candidates:
            return None
    else:
        path = Path(resume)
        candidates = [path] if (path / "trainer_state.json").exists() else checkpoints(path) if path.exists() else []
        if not candidates:
            raise FileNotFoundError(f"resume={resume!r} is neither a checkpoint nor a run dir with checkpoints")
    for folder in reversed(candidates):
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder
        warn(f"warning: checkpoint {folder} is unusable: {problem}; trying the previous one")
    raise FileNotFoundError(f"no usable checkpoint among {[str(c) for c in candidates]} (see the warnings above)")


def resolve_resume_on_main(accelerator, resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint to resume from, verified once by the main process (resolve_resume);
    every rank gets its answer, or its error."""
    from accelerate.utils import broadcast_object_list

    answer = [None]
    if accelerator.is_main_process:
        try:
            answer = [("ok", resolve_resume(resume, run_dir, warn=print))]
        except FileNotFoundError as e:
            answer = [("error", str(e))]
    broadcast_object_list(answer)
    kind, value = answer[0]
    if kind == "error":
        raise FileNotFoundError(value)
    return value
