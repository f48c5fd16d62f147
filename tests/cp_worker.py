"""Worker for tests/test_context_parallel.py: every registered mixer (two layers of it, and again with
allow_neg_eigval where its Options have it, and VARIANTS) and a hybrid (softmax, gdn and mamba2 layers with MoE
FFNs), each trained one step under context parallelism against one process; WHOLE_ROWS again on rows of one
document each (no document positions), FSDP again sharded by FSDP2 over all the processes.

    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml --num_processes W -m tests.cp_worker OUT CP[,CP...] [CASES]

For each CP, the W processes form (W / CP data replicas) x (CP context ranks) through training/parallel.py,
as a run does. Data: 2 rows per data replica of T = 92 tokens (23 per rank at CP 4, 46 at CP 2: not a multiple of any
op's chunk), with packed documents that start on either side of the rank edges, exactly on one, and cross
several; a row of one document. The reference, on every rank: one process (the same model, in the same dtype)
through each replica's rows in turn, the mean of their losses backward (what DDP of the replicas equals: one process with
accumulation). Context parallel: each rank's loss over its replica's rows with `context`, backward, each
gradient averaged over all W processes (as DDP does). The main process writes OUT/cp<CP>_world<W>.json: the
sizes that ran and, per case, the relative error of the loss, of the aux metrics, and of every parameter's
gradient (float64; float32 at the first CP size), and the kinds of exchange that ran with their bytes."""
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from model import DecoderLM, LMConfig
from model.registry import MIXERS

VOCAB, T, ROWS = 64, 92, 2
# document starts per row (besides 0): edges at 23, 46, 69 (CP 4) and 46 (CP 2)
STARTS = [[10, 23, 50, 69, 80], [], [40, 46, 47], [5, 30, 60]]


# beyond a mixer's defaults: DSA selecting fewer keys than most queries see, and its dense warm-up stage
EXTRA = {"dsa": {"topk": 16}}
VARIANTS = {"dsa+warmup": ("dsa", {"topk": 16, "stage": "warmup"})}


def cases() -> dict:
    """name -> (layers, mixer options, ffn, ffn options): every registered mixer, with negative eigenvalues where
    its Options have them, VARIANTS, and a hybrid with MoE FFNs."""
    out = {}
    for name in MIXERS.names():
        out[name] = ([name, name], {name: EXTRA.get(name, {})}, "dense", {})
        options = getattr(MIXERS.get(name), "Options", None)
        if options is not None and "allow_neg_eigval" in {f.name for f in dataclasses.fields(options)}:
            out[f"{name}+neg"] = ([name, name], {name: {"allow_neg_eigval": True}}, "dense", {})
    for variant, (name, options) in VARIANTS.items():
        out[variant] = ([name, name], {name: options}, "dense", {})
    moe = {"moe": {"num_experts": 4, "top_k": 2, "num_shared_experts": 1, "sequence_balance_loss_coef": 0.1,
                   "num_expert_groups": 2, "group_balance_loss_coef": 0.1}}
    out["hybrid+moe"] = (["softmax", "gdn", "mamba2"], {}, "moe", moe)
    return out


WHOLE_ROWS = ("softmax", "hybrid+moe")  # run again without document positions: every row one document
FSDP = ("hybrid+moe",)  # run again sharded by FSDP2 over every process


def build(layers, mixer_options, ffn, ffn_options, dtype=torch.float32) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM(LMConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=len(layers), num_attention_heads=2,
                               num_key_value_heads=1, intermediate_size=64, max_position_embeddings=128, mixer=layers,
                               mixer_options=mixer_options, ffn=ffn, ffn_options=ffn_options))
    with torch.no_grad():  # off its init, so that gates at their init hide no term
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.to(dtype).train()


def batch(replicas: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (replicas * ROWS, T), generator=g)
    positions = torch.empty(replicas * ROWS, T, dtype=torch.long)
    for row in range(replicas * ROWS):
        starts = [0] + STARTS[row % len(STARTS)]
        for a, b in zip(starts, starts[1:] + [T]):
            positions[row, a:b] = torch.arange(b - a)
    return ids, positions


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.norm().item()
    return (a - b).norm().item() / scale if scale > 0 else (a - b).abs().max().item()


def one_process(case, ids, positions, replicas: int, dtype) -> dict:
    """The reference: one process through each replica's rows in turn, the mean of their losses backward.
    Returns ({"loss", "aux <metric>", <parameter>: value or gradient}, ...)."""
    rows = [slice(r * ROWS, (r + 1) * ROWS) for r in range(replicas)]
    model = build(*case, dtype)
    outs = [model(input_ids=ids[s], labels=ids[s], position_ids=None if positions is None else positions[s]) for s in rows]
    loss = sum(o.loss for o in outs) / replicas
    loss.backward()
    values = {"loss": loss.detach(), **{f"aux {k}": sum(o.aux_metrics[k] for o in outs) / replicas
                                        for k in outs[0].aux_metrics}}
    return {**values, **{name: p.grad for name, p in model.named_parameters()}}


def context_parallel(case, ids, positions, context, share, dtype, fsdp: bool = False) -> dict:
    """The same under context parallelism, each value averaged over all processes (as DDP averages gradients), or
    with fsdp the model sharded by torch's FSDP2 over all processes (fully_shard per Block and at the root), whose
    reduce-scatter averages the gradients itself."""
    from torch.distributed.fsdp import fully_shard

    s = slice(share.rank * ROWS, (share.rank + 1) * ROWS)
    model = build(*case, dtype)
    if fsdp:
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    out = model(input_ids=ids[s], labels=ids[s], position_ids=None if positions is None else positions[s], context=context)
    out.loss.backward()
    values = {"loss": out.loss.detach(), **{f"aux {k}": v.detach() for k, v in out.aux_metrics.items()}}
    grads = {name: p.grad.full_tensor() if fsdp else p.grad for name, p in model.named_parameters()}
    averaged = {**values, **({} if fsdp else grads)}  # in one all-reduce: a collective per tensor is slow on shared cores
    flat = torch.cat([v.reshape(-1) for v in averaged.values()]) / dist.get_world_size()
    dist.all_reduce(flat)
    values = dict(zip(averaged, (t.view_as(v) for t, v in zip(flat.split([v.numel() for v in averaged.values()]),
                                                               averaged.values()))))
    return {**grads, **values}


def compare(case, context, share, replicas: int, float32: bool, documents: bool = True, fsdp: bool = False) -> dict:
    """Per value (the loss, each aux metric, each parameter's gradient), its relative error under context
    parallelism: in float64 (the exchanges' math, against one process in float64) and, with float32, in float32
    (against one process in float32), with float32's own error there (one process in float32 against float64, its
    floor) and context parallelism's in float32 against float64."""
    ids, positions = batch(replicas)
    positions = positions if documents else None
    ref64 = one_process(case, ids, positions, replicas, torch.float64)
    cp64 = context_parallel(case, ids, positions, context, share, torch.float64, fsdp)
    errors = {key: {"float64": relative(cp64[key], ref64[key])} for key in ref64}
    if float32:
        ref32 = one_process(case, ids, positions, replicas, torch.float32)
        cp32 = context_parallel(case, ids, positions, context, share, torch.float32, fsdp)
        for key, e in errors.items():
            e.update(float32=relative(cp32[key].double(), ref32[key].double()),
                     float32_floor=relative(ref32[key].double(), ref64[key]),
                     float32_own=relative(cp32[key].double(), ref64[key]))
    return {"errors": errors, "exchanges": context.take_sent(), "unmasked_attention": UNMASKED.pop("calls", 0)}


UNMASKED: dict = {}  # calls of softmax's unmasked context-parallel attention (rows of one document) in a case


def count_unmasked_attention() -> None:
    import model.mixers.softmax as softmax

    attention = softmax.causal_attention_after

    def counted(*args, **kwargs):
        UNMASKED["calls"] = UNMASKED.get("calls", 0) + 1
        return attention(*args, **kwargs)

    softmax.causal_attention_after = counted


def main(out: Path, sizes: list[int], only: list[str] | None = None) -> None:
    """Each context-parallel size in turn on the same processes (CP 4 on 4, then 2 data replicas x CP 2), float32 too
    at the first."""
    from accelerate import PartialState

    from training.parallel import apply_context_parallel, check_context_parallel

    torch.set_num_threads(1)
    count_unmasked_attention()
    state = PartialState(cpu=True)
    W = state.num_processes
    every = {name: case for name, case in cases().items() if not only or name in only}
    for cp in sizes:
        context, share = apply_context_parallel(build(*next(iter(every.values()))), cp, W, state.process_index, "cpu", T)
        result = {"world_size": W, "cp_size": context.size, "dp_size": share.size, "cases": {}}
        for name, case in every.items():
            check_context_parallel(build(*case), cp, W, T)  # each case is one a run would take
            result["cases"][name] = compare(case, context, share, W // cp, float32=cp == sizes[0])
            if name in WHOLE_ROWS:
                result["cases"][f"{name}, whole rows"] = compare(case, context, share, W // cp, float32=cp == sizes[0],
                                                                documents=False)
            if name in FSDP:
                result["cases"][f"{name}, FSDP2"] = compare(case, context, share, W // cp, float32=cp == sizes[0],
                                                           fsdp=True)
        if state.is_main_process:
            (out / f"cp{cp}_world{W}.json").write_text(json.dumps(result, indent=1))
    state.wait_for_everyone()
    state.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(n) for n in sys.argv[2].split(",")], sys.argv[3].split(",") if len(sys.argv) > 3 else None)
