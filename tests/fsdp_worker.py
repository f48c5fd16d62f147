"""Worker for tests/test_distributed.py::test_fsdp_export_and_checkpoint_round_trip, launched with
`torchrun --nproc_per_node 2 -m tests.fsdp_worker` from the repo root on CPU (gloo): a tiny DecoderLM
sharded with torch's FSDP2 (fully_shard per Block and at the root) trains two steps, then
1. exports final/ through training.checkpoint.export_final (every rank joins the gather);
2. checkpoints through save_checkpoint (DCP shards), trains a third step, and
3. loads the checkpoint into a fresh sharded model + optimizer and retrains that third step.
Rank 0 writes result.json: the world size, the losses, and the sharded model's logits on a fixed
batch, which the test compares against the exported model run in one plain process."""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from model import DecoderLM, LMConfig
from training.checkpoint import checkpoint_problem, export_final, load_checkpoint, save_checkpoint

CONFIG = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, mixer=["softmax", "gdn"], ffn="moe")


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))


def build(seed: int = 0):
    torch.manual_seed(seed)
    lm = DecoderLM(LMConfig(**CONFIG))
    for block in lm.layers:
        fully_shard(block)
    fully_shard(lm)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return lm, optimizer, scheduler


def train_step(lm, optimizer, scheduler, step: int) -> float:
    ids = batch(step, dist.get_rank())
    loss = lm(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    reduced = loss.detach().clone()
    dist.all_reduce(reduced)
    return reduced.item() / dist.get_world_size()


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    lm, optimizer, scheduler = build()
    losses = [train_step(lm, optimizer, scheduler, s) for s in range(2)]
    export_final(lm, None, "trained by fsdp_worker\n", out)
    probe = torch.arange(16).view(1, 16) % 128
    with torch.no_grad():
        logits = lm(probe).logits
    save_checkpoint(out, lm, [optimizer], scheduler, {"step": 2}, keep=1)
    ckpt = out / "checkpoints" / "step_0000002"
    third = train_step(lm, optimizer, scheduler, 2)

    fresh, fresh_opt, fresh_sched = build(seed=1)  # different init: everything must come from the checkpoint
    state = load_checkpoint(ckpt, fresh, [fresh_opt], fresh_sched)
    third_again = train_step(fresh, fresh_opt, fresh_sched, 2)
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps({
            "world_size": dist.get_world_size(), "losses": losses, "third": third, "third_after_resume": third_again,
            "resumed_step": state["step"], "lr_after_resume": fresh_sched.get_last_lr()[0],
            "lr": scheduler.get_last_lr()[0], "checkpoint_problem": checkpoint_problem(ckpt),
            "shard_files": sorted(p.name for p in (ckpt / "state").glob("*.distcp")),
            "probe_logits": logits[0, :, :8].tolist()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # Leave without the interpreter's teardown: there, after the group is destroyed and the results
    # written, a native thread left joinable aborts some exits ("terminate called without an active
    # exception", exit -6) on gloo with FSDP2, which would fail the run for nothing this test checks.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
