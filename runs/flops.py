"""Training FLOPs per token: each part of a model (DecoderLM.flops_by_part) charged 3x its forward where any of its
own parameters trains, 1x where none does. What a run records as train_flops_per_token (run_info.json), what its
budget buys steps with (training/budget.py) and what the report counts older runs with (analysis/summary.py)."""

TRAINED, FROZEN = 3, 1  # forward FLOPs charged per forward FLOP: forward + backward (inputs, weights); forward only


def part_costs(lm, seq_len: int, device, trains=lambda p: p.requires_grad) -> dict[str, float]:
    """Training FLOPs per token of each part of `lm` (DecoderLM.flops_by_part on `device`): TRAINED x its forward if
    `trains` picks any of its own parameters (those of its module less its own parts'), else FROZEN x. A frozen
    part's backward for its input, where gradients pass through it to a part before it, is not charged. The
    whole-model forwards without grad a training forward runs beside its own (DecoderLM.eval_forwards_per_step)
    are one more entry, "eval_forward", FROZEN x the model's forward each."""
    parts = lm.flops_by_part(seq_len, device)
    costs = {}
    for name, flops in parts.items():
        inner = [p for sub in parts if sub.startswith(name + ".") for p in lm.get_submodule(sub).parameters()]
        own = [p for p in lm.get_submodule(name).parameters() if not any(p is q for q in inner)]
        costs[name] = flops * (TRAINED if any(trains(p) for p in own) else FROZEN)
    if forwards := lm.eval_forwards_per_step():
        costs["eval_forward"] = FROZEN * forwards * sum(parts.values())
    return costs


def training_flops_per_token(lm, seq_len: int, device, trains=lambda p: p.requires_grad) -> float:
    """Training FLOPs per token of a step of `lm` that trains the parameters `trains` picks (part_costs summed)."""
    return sum(part_costs(lm, seq_len, device, trains).values())
