"""A self-check stage run end to end: its budget and environment printed, its checks run, the summary table,
the results written to JSON, the exit status (scripts/gpu_check.py is its command line)."""
import json
import time
from pathlib import Path

import torch

from checks.model import KERNEL_CHECKS
from checks.stage import Stage, summary_table
from checks.train import TRAIN_CHECKS, train_table
from common.files import written_then_renamed

ROOT = Path(__file__).resolve().parents[1]
SETUP_S = 20  # imports and CUDA start-up before the first check: the budget's part no deadline bounds
STAGES = {"kernels": (240, KERNEL_CHECKS), "train": (300, TRAIN_CHECKS)}  # budget s on one H100/H200, checks


def environment(cuda: bool) -> dict:
    import importlib.metadata as md

    def version(package):
        try:
            return md.version(package)
        except md.PackageNotFoundError:
            return None

    return {"torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "triton": version("triton"),
            "flash-linear-attention": version("flash-linear-attention")}


def run_stage(name: str, mixers: list[str], json_path: Path | None = None) -> int:
    """Stage `name` (STAGES) with these mixers trained in stage train; the results in json_path (default
    outputs/gpu_check/<stage>.json); 1 on any mismatch, else 0."""
    budget, checks = STAGES[name]
    cuda = torch.cuda.is_available()
    env = environment(cuda)
    print(f"gpu_check stage {name}: budget {budget // 60} min {budget % 60:02d} s on one H100/H200 "
          f"({SETUP_S} s start-up + check deadlines {' + '.join(f'{c.name} {c.deadline_s:.0f}' for c in checks)} s)")
    print(" | ".join(f"{k} {v}" for k, v in env.items() if v))
    stage = Stage(name, budget, cuda, mixers)
    stage.run(checks)

    print(f"\nsummary: stage {name}, {time.perf_counter() - stage.t_start:.1f} s of its {budget} s budget")
    print("\n".join(summary_table(stage, checks)))
    if name == "train" and cuda:
        print("\n".join(train_table(stage)))
    if not cuda:
        print("CUDA is not available: ran the CPU part only. " + ", ".join(c.name for c in checks if c.needs_cuda) +
              " need a CUDA GPU with requirements-gpu.txt installed.")
    problems = stage.problems()
    path = json_path or ROOT / "outputs" / "gpu_check" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_then_renamed(path) as tmp:
        tmp.write_text(json.dumps({"stage": name, "budget_s": budget, "seconds": round(time.perf_counter() - stage.t_start, 1),
                                   "passed": not problems, **env, "plan": stage.plan, "results": stage.rows}, indent=1))
    print(f"results: {path}")
    for line in problems:
        print(line)
    print(f"{len(problems)} mismatch(es)" if problems else "all checks passed")
    return 1 if problems else 0
