"""Evaluation shared by train.py and scripts/evaluate.py: val loss / perplexity / bits per byte,
per-position loss, aux metrics, and generation samples with decode speed."""
import math
import time

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
