"""Worker for tests/test_moe_routers_ddp.py: tiny MoE LMs, one per router (each with 2 expert groups
and every balance loss it takes on), trained 3 steps through the loop's own train_step (training/loop.py) on Accelerate, in
memory (a fixed random corpus, no Hydra, no tokenizer), so one launch covers every router.

    python -m tests.moe_routers_ddp_worker OUT GRAD_ACCUM                    # 1 process
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml -m tests.moe_routers_ddp_worker OUT 1

The main process writes OUT/world<N>.json: the process count that ran, and per router the losses
and aux metrics train_step returned at each step (means over all processes' micro-batches) and
the final weights of the first MoE layer."""
import json
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from model.ffn.routers import ROUTERS as REGISTERED

LOSSES = dict(balance_loss_coef=0.1, sequence_balance_loss_coef=0.1, group_balance_loss_coef=0.1)
# What each router runs with beyond its defaults, where it has something more to exercise: every registered
# router runs (a new one at its defaults, with the balance losses).
EXTRA = {
    "topk": dict(router_options=dict(max_groups_per_token=1), aux_free_bias=True, **LOSSES),
    "expert_choice": dict(router_options=dict(capacity_factor=0.75), **LOSSES),
    "hash": dict(),  # no router scores, so no balance losses
    "reinforce": dict(aux_free_bias=True, router_options=dict(entropy_coef=0.01, policy="set", temperature_start=2.0,
                                                           temperature_end=1.0, temperature_steps=2), **LOSSES),
}
ROUTERS = {name: EXTRA.get(name, LOSSES) for name in REGISTERED.names()}
SHAPE = dict(num_experts=4, top_k=2, expert_intermediate_size=16, num_expert_groups=2)
BATCH, SEQ_LEN, VOCAB = 8, 16, 64


class Corpus:
    """32 random sequences; batch(indices) as the training split gives them."""

    def __init__(self):
        self.ids = torch.randint(0, VOCAB, (32, SEQ_LEN), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, indices: torch.Tensor) -> dict:
        ids = self.ids[indices]
        return {"input_ids": ids, "labels": ids}


def train_router(accelerator, router: str, grad_accum: int) -> dict:
    from accelerate.utils import set_seed

    from model import DecoderLM, LMConfig
    from training.loop import train_step
    from training.objectives import OBJECTIVES
    from training.run import Run

    set_seed(0)
    lm = DecoderLM(LMConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, ffn="moe",
                            ffn_options={"moe": dict(router=router, **SHAPE, **ROUTERS[router])}))
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer = accelerator.prepare(lm, optimizer)
    cfg = OmegaConf.create({"seed": 0, "init_from": None,
                            "trainer": {"batch_size": BATCH, "grad_accum": grad_accum, "grad_clip": 1.0, "trainable": None}})
    run = Run(cfg=cfg, accelerator=accelerator, run_dir=Path("."), data=type("Data", (), {"train": Corpus()})(),
              lm=lm, model=model, objective=OBJECTIVES.get("lm")(cfg, lm, accelerator, None), optimizer=optimizer, optimizers=[optimizer.optimizer], scheduler=scheduler,
              micro=BATCH // (accelerator.num_processes * grad_accum), costs=None, phase_ends={}, step=0,
              t_origin=time.time(), last_ckpt=None)
    steps = []
    for _ in range(3):
        loss, aux, _ = train_step(run)
        steps.append({"loss": loss, **{k: v.tolist() for k, v in aux.items()}})
    moe = lm.layers[0].ffn
    return {"steps": steps, "weights": {k: v.tolist() for k, v in moe.state_dict().items()}}


def main(out: Path, grad_accum: int) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    result = {"world_size": accelerator.num_processes,
              "routers": {router: train_router(accelerator, router, grad_accum) for router in ROUTERS}}
    if accelerator.is_main_process:
        (out / f"world{accelerator.num_processes}.json").write_text(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
