"""Evaluation shared by train.py and eval.py: val loss / perplexity / bits per byte, per-position loss,
aux metrics, generation samples with decode speed, and lm-evaluation-harness tasks."""
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from data.types import Split
from training.metrics import perplexity


@torch.no_grad()
def evaluate_split(model, split: Split, batch_size: int, max_sequences: int | None, device,
                   bytes_per_token: float | None, rank: int = 0, world: int = 1, autocast=None,
                   per_position: bool = False) -> dict:
    """Token-weighted mean loss over the first max_sequences blocks of the split (all if None), each
    rank taking a contiguous share in forwards of batch_size; returns sums so that callers can reduce
    across ranks. The blocks scored depend only on max_sequences, never on the process count. Every
    rank runs the same number of forwards (a rank whose share is one batch short runs a filler
    batch it does not count), as a model sharded by FSDP needs all ranks in each forward."""
    was_training = model.training
    model.eval()
    n = len(split) if max_sequences is None else min(len(split), max_sequences)
    shares = torch.arange(n).tensor_split(world)
    share = shares[rank]
    batches_per_rank = -(-len(shares[0]) // batch_size)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    pos_sum = pos_count = None
    aux_sums: dict[str, torch.Tensor] = {}
    batches = 0
    chunks = list(share.split(batch_size))
    for i in range(batches_per_rank):
        filler = i >= len(chunks)  # a forward that only keeps this rank in step with the others
        idx = shares[0][:batch_size] if filler else chunks[i]
        batch = {k: v.to(device) for k, v in split.batch(idx).items()}
        with autocast() if autocast else torch.autocast(device.type, enabled=False):
            out = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"))
        logits = out.logits[:, :-1].float()
        targets = batch["labels"][:, 1:]
        token_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                     reduction="none").view_as(targets).double()
        if filler:
            continue
        mask = targets != -100
        loss_sum += token_loss[mask].sum()
        count += mask.sum()
        if per_position:
            pos_sum = (token_loss * mask).sum(0) if pos_sum is None else pos_sum + (token_loss * mask).sum(0)
            pos_count = mask.sum(0) if pos_count is None else pos_count + mask.sum(0)
        for k, v in (out.aux_metrics or {}).items():
            aux_sums[k] = aux_sums.get(k, 0) + v.double()
        batches += 1
    model.train(was_training)
    result = {"loss_sum": loss_sum, "count": count, "aux": {k: v / max(batches, 1) for k, v in aux_sums.items()}}
    if per_position:
        result["per_position"] = (pos_sum / pos_count.clamp(min=1)).cpu()
    return result


def batch_routing_scores(scores: dict[str, float]) -> dict[str, float]:
    """summarize()'s val/ scores of an evaluation with batch routing (model/ffn/moe.py
    batch_routing_at_eval) under val/batch_routing/."""
    return {f"val/batch_routing/{k.removeprefix('val/')}": v for k, v in scores.items()}


def summarize(loss_sum: float, count: float, bytes_per_token: float | None) -> dict[str, float]:
    loss = loss_sum / max(count, 1)
    out = {"val/loss": loss, "val/ppl": perplexity(loss)}
    if bytes_per_token:
        out["val/bpb"] = loss / math.log(2) / bytes_per_token
    return out


@torch.no_grad()
def sample(model, tokenizer, prompt: str, max_new_tokens: int, seed: int, device, *, temperature: float, top_p: float,
           repetition_penalty: float) -> dict:
    """A sample through transformers' generate, seeded (torch's global generator) so that the text
    is reproducible: temperature 0 is greedy, else nucleus sampling (top_p; no top-k cut); a
    repetition_penalty > 1 divides the positive logits (multiplies the negative) of every token
    already in the text (CTRL, arXiv:1909.05858), which keeps small models out of loops. Also
    returns decode tokens/s (new tokens over wall time after the prompt's prefill)."""
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
    settings = {"do_sample": False} if temperature == 0 else {
        "do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_new_tokens, repetition_penalty=repetition_penalty, **settings,
                         pad_token_id=tokenizer.eos_token_id, eos_token_id=None)
    seconds = time.perf_counter() - t0
    new = out.shape[1] - ids.shape[1]
    return {"text": tokenizer.decode(out[0], skip_special_tokens=False), "new_tokens": new,
            "decode_tokens_per_sec": new / seconds}


def plot_per_position(losses: list[float], title: str, path: Path) -> Path:
    """The val loss at each position (log x): how much later tokens gain from their context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(2, len(losses) + 2), losses)  # position t + 1 is predicted from t + 1 tokens of context
    ax.set_xscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{title}: val loss by position")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def harness_model(model, folder: Path, device, batch_size: int = 8):
    """`model` with the tokenizer saved in `folder` as lm-evaluation-harness's HFLM (requirements-eval.txt).
    Our model takes unpadded sequences only: log-likelihood requests run at any batch size, generation
    requests need batch size 1."""
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
