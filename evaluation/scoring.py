"""The one validation scorer, shared by the training loop and eval.py: loss, perplexity and bits per byte
over the first N val sequences (every process scoring its share), the aux metrics of those forwards, a
second pass with batch routing for a MoE whose router is not causal, and the data's own evaluation
(MQAR accuracy)."""
import math

import torch
import torch.nn.functional as F

from data.types import Data, Split


@torch.no_grad()
def evaluate_split(model, split: Split, batch_size: int, max_sequences: int | None, device, rank: int = 0,
                   world: int = 1, autocast=None, per_position: bool = False, context=None) -> dict:
    """Token-weighted mean loss over the first max_sequences blocks of the split (all if None), each
    rank taking a contiguous share in forwards of batch_size; returns sums so that callers can reduce
    across ranks. The blocks scored depend only on max_sequences, never on the process count. Every
    rank runs the same number of forwards (a rank whose share is one batch short runs a filler
    batch it does not count), as a model sharded by FSDP needs all ranks in each forward. With a context
    (context parallelism: rank and world are then the data replica's), each process scores its slice of the
    share's sequences (the model's forward with context), and the sums over all processes cover each
    sequence once."""
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
            out = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"),
                        **({} if context is None else {"context": context}))
        logits, targets = out.logits, batch["labels"][:, 1:]  # position t predicts t + 1
        if context is None:
            logits = logits[:, :-1]
        else:  # this rank's slice; the rows' last position predicts nothing
            targets = F.pad(targets, (0, 1), value=-100)[:, slice(*context.bounds(targets.shape[1] + 1))]
        token_loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
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


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def summarize(loss_sum: float, count: float, bytes_per_token: float | None) -> dict[str, float]:
    loss = loss_sum / max(count, 1)
    out = {"val/loss": loss, "val/ppl": perplexity(loss)}
    if bytes_per_token:
        out["val/bpb"] = loss / math.log(2) / bytes_per_token
    return out


def score_validation(model, data: Data, batch_size: int, max_sequences: int | None, device, *, rank: int = 0,
                     world: int = 1, autocast=None, reduce_sum=None, per_position: bool = False, context=None) -> dict:
    """val/loss, val/ppl, val/bpb and val/tokens over the first max_sequences val sequences, each of the
    `world` processes scoring its share in forwards of batch_size (reduce_sum(x): x summed over the
    processes; None with one process); val/<aux metric> of those forwards, token-weighted over processes; a
    model whose blocks declare evaluation variants (model/layers.py eval_variant_names: a non-causal MoE router's
    training routing over each forward's batch, "batch_routing") scored again under each, as val/<variant>/...;
    the data's own evaluation (MQAR accuracy).
    With per_position (one process), also "per_position": the mean loss at each position. With a context
    (context parallelism) rank and world are this process's data replica and their count (evaluate_split)."""
    from model.layers import eval_variant, eval_variant_names

    reduce_sum = reduce_sum or (lambda x: x)

    def scored() -> tuple[dict, dict]:
        r = evaluate_split(model, data.val, batch_size, max_sequences, device, rank, world, autocast, per_position, context)
        sums = reduce_sum(torch.stack([r["loss_sum"], r["count"]]))
        return {**summarize(sums[0].item(), sums[1].item(), data.bytes_per_token), "val/tokens": int(sums[1].item())}, r

    out, r = scored()
    tokens = out["val/tokens"]
    # r["aux"] holds this rank's means over its forwards: the mean over all ranks weights each by its tokens
    aux = reduce_sum({k: v * r["count"] for k, v in r["aux"].items()}) if r["aux"] else {}
    out.update({f"val/{k}": (v / max(tokens, 1)).float() for k, v in aux.items()})
    if per_position:
        out["per_position"] = r["per_position"].tolist()
    for name in eval_variant_names(model):  # e.g. expert_choice / balanced: the same sequences routed as in training
        with eval_variant(model, name):
            varied, _ = scored()
        out.update({f"val/{name}/{k.removeprefix('val/')}": v for k, v in varied.items() if k != "val/tokens"})
    if data.extra_eval is not None:
        out.update(data.extra_eval(model, device))
    return out
