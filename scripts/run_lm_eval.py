"""Run EleutherAI's lm-evaluation-harness on a trained checkpoint.

    pip install -r requirements-eval.txt    # lm-eval (heavy: scipy, scikit-learn, nltk, ...)
    python -m scripts.run_lm_eval outputs/<date>/<run>/final --tasks lambada_openai,hellaswag [--limit 200]
        [--include-path my_tasks/] [--num-fewshot 0] [--batch-size 8] [--device cuda] [--out results.json]

The checkpoint (an HF dir, or a run dir whose final/ is used) is loaded with
AutoModelForCausalLM.from_pretrained after `import model` registers the architecture, and handed
to the harness's HFLM wrapper as a model object with its tokenizer. --include-path adds a folder
of task YAMLs (e.g. a local jsonl task). DecoderLM takes unpadded sequences only: loglikelihood
tasks (multiple choice, perplexity) work at any batch size; generation tasks need --batch-size 1.
Prints task / metric / value; --out writes the results dict as JSON.

Run it with -m from the repo root: run by path, scripts/ comes first on the import path, and its
evaluate.py would stand in for the `evaluate` package that some lm-eval tasks import.
"""
import argparse
import json
import sys
from pathlib import Path


def load(checkpoint: str | Path, device: str):
    """(model, tokenizer) of an HF dir, a run dir or a mid-run checkpoint dir."""
    import torch
    from transformers import AutoTokenizer

    from training.checkpoint import load_lm, weights_dir

    folder = weights_dir(checkpoint)
    if not (folder / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"{folder} has no tokenizer (synthetic-data runs such as MQAR cannot be scored on text tasks)")
    lm = load_lm(folder, dtype=torch.float32).to(device).eval()
    return lm, AutoTokenizer.from_pretrained(folder)


def evaluate(checkpoint, tasks: list[str], include_path: str | None = None, limit: float | None = None,
             num_fewshot: int | None = None, batch_size: int = 8, device: str = "cpu") -> dict:
    """lm_eval.simple_evaluate on the loaded model; returns the harness's results dict."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm, tokenizer = load(checkpoint, device)
    wrapped = HFLM(pretrained=lm, tokenizer=tokenizer, batch_size=batch_size, device=device,
                   max_length=lm.config.max_position_embeddings)
    # Indexing the ~10k built-in task YAMLs takes a while: skip it when --include-path has every task.
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=include_path)
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        raise ValueError(f"unknown lm-eval task(s) {missing}; list them with `lm-eval ls tasks`"
                         + (f" or add YAMLs under {include_path}" if include_path else " or pass --include-path"))
    return lm_eval.simple_evaluate(model=wrapped, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                   task_manager=manager, log_samples=False, bootstrap_iters=0)


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="HF model dir, run dir (its final/) or checkpoint dir (checkpoints/step_N)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", help="folder of extra task YAMLs")
    p.add_argument("--limit", type=float, help="examples per task (or a fraction if < 1)")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    try:
        results = evaluate(args.checkpoint, args.tasks.split(","), args.include_path, args.limit, args.num_fewshot,
                           args.batch_size, args.device)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print(f"{'task':<24} {'metric':<20} {'value':>8}")
    for task, metrics in results["results"].items():
        for name, value in metrics.items():
            if isinstance(value, float) and "stderr" not in name:
                print(f"{task:<24} {name.removesuffix(',none'):<20} {value:>8.4f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({k: results[k] for k in ("results", "versions", "n-shot", "config") if k in results},
                                       indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
