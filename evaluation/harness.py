"""lm-evaluation-harness tasks on a trained model (requirements-eval.txt): `python eval.py checkpoint=...
tasks=[lambada_openai]`."""
from pathlib import Path


def harness_model(model, folder: Path, device, batch_size: int = 8):
    """`model` with the tokenizer saved in `folder` as lm-evaluation-harness's HFLM (requirements-eval.txt), at
    any batch size: the model takes the harness's padded batches (DecoderLM.forward's attention_mask)."""
    try:
        from lm_eval.models.huggingface import HFLM
    except ImportError as e:
        raise ValueError(f"lm-eval tasks need lm-evaluation-harness ({e}); pip install -r requirements-eval.txt") from e
    from transformers import AutoTokenizer

    if not (Path(folder) / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"{folder} has no tokenizer (synthetic-data runs such as MQAR cannot be scored on text tasks)")
    return HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(folder), batch_size=batch_size,
                device=str(device), max_length=model.config.max_position_embeddings)


def lm_eval_scores(model, folder: Path, tasks: list[str], device, include_path: str | None = None,
                   limit: float | None = None, num_fewshot: int | None = None, batch_size: int = 8) -> dict:
    """lm-evaluation-harness tasks on `model` (harness_model): {task: {metric: value}}, the harness's
    aggregate metrics without their stderr."""
    wrapped = harness_model(model, folder, device, batch_size)
    import lm_eval
    from lm_eval.tasks import TaskManager

    # Indexing the ~10k built-in task YAMLs takes a while: skip it when include_path has every task.
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=include_path)
    if missing := [t for t in tasks if t not in manager.all_tasks]:
        raise ValueError(f"unknown lm-eval task(s) {missing}; list them with `lm-eval ls tasks`"
                         + (f" or add YAMLs under {include_path}" if include_path else " or set include_path"))
    results = lm_eval.simple_evaluate(model=wrapped, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                      task_manager=manager, log_samples=False, bootstrap_iters=0)["results"]
    return {task: {name.removesuffix(",none"): value for name, value in metrics.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in name}
            for task, metrics in results.items()}
