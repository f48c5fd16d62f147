"""A training run's setup: `setup(cfg) -> Run` builds data, model, optimizer and trackers from the
Hydra config (configs/train.yaml) on Accelerate (one CPU/GPU process, or DDP/FSDP under
`accelerate launch`), writes <run_dir>/config.yaml and run_info.json, and resumes if asked.
training/loop.py runs the loop on the Run."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig, OmegaConf

from runs.config import lm_config

if TYPE_CHECKING:  # the types only: these import accelerate, the model and the data at setup, not at import
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from torch.distributed.device_mesh import DeviceMesh

    from data import Data
    from model import DecoderLM
    from model.ops.context_parallel import ContextGroup
    from training.budget import StepCosts
    from training.objectives import Objective
    from training.parallel import DataShare


@dataclass
class Run:
    """What the loop needs: the config, Accelerate, data, the model (`lm` is the DecoderLM itself,
    `model` what Accelerate prepared around the objective's module), the objective (training/objectives/),
    the optimizer (as prepared; `optimizers` are the torch optimizers inside it, whose state is
    checkpointed), and where the run stands."""
    cfg: DictConfig
    accelerator: Accelerator
    run_dir: Path
    data: Data
    lm: DecoderLM
    model: torch.nn.Module  # the objective's module as Accelerate prepared it (DDP, FSDP2, compiled)
    objective: Objective
    optimizer: AcceleratedOptimizer
    optimizers: list[torch.optim.Optimizer]
    scheduler: torch.optim.lr_scheduler.LRScheduler
    micro: int             # sequences per data replica per micro-step
    costs: StepCosts       # training FLOPs per token of each step (the objective's)
    phase_ends: dict[int, str]  # {step: the objective's phase that ends there}: the loop logs and evaluates there
    step: int
    t_origin: float        # time/elapsed counts from here (moved back on resume)
    last_ckpt: Path | None
    expert_mesh: DeviceMesh | None = None  # the (dp, ep) mesh with trainer.expert_parallel > 1 (training/parallel.py)
    context: ContextGroup | None = None    # this process's context group with trainer.context_parallel > 1
    share: DataShare | None = None         # the context groups' data share; None: each process its own

    @property
    def data_share(self):
        """Which share of each global batch this process reads (training.parallel.DataShare): its data
        replica's under context parallelism, else its own."""
        from training.parallel import DataShare

        return self.share or DataShare(self.accelerator.process_index, self.accelerator.num_processes)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.trainer.batch_size * self.cfg.trainer.seq_len


def device_type() -> str:
    """The device a run trains on: "cuda" where one is available, else "cpu" (FLOP counts follow its ops' path)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def setup(cfg: DictConfig) -> Run:
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedDataParallelKwargs, broadcast_object_list, set_seed
    from hydra.core.hydra_config import HydraConfig

    from data import build_data
    from model import DecoderLM
    from training import checkpoint as ckpt
    from training.objectives import OBJECTIVES
    from training.optim import build_optimizer, build_scheduler, torch_optimizers
    from training.parallel import apply_parallel, micro_batch
    from training.budget import StepCosts, check_steps, set_steps_from_budget

    t_start = time.time()
    tc = cfg.trainer
    use_cuda = device_type() == "cuda"
    state = PartialState(cpu=not use_cuda)
    world = state.num_processes
    micro = micro_batch(tc, state)

    # One run directory for all ranks: the main process's.
    run_dir = [cfg.run_dir or HydraConfig.get().runtime.output_dir]
    broadcast_object_list(run_dir)
    run_dir = Path(run_dir[0])
    set_seed(cfg.seed)

    # Data: prepared by one process first, so the tokenizer/token caches are written once: the
    # main process when the cache is one filesystem for all nodes, else each node's local main.
    with state.main_process_first() if cfg.data.get("cache_shared") else state.local_main_process_first():
        data = build_data(cfg.data, tc.seq_len, cfg.seed)
    eos = data.tokenizer.eos_token_id if data.tokenizer is not None else None
    lm = DecoderLM(lm_config(cfg, data.vocab_size, eos))
    objective = OBJECTIVES.get(cfg.objective)(cfg, lm, state, data)  # what the run starts from, trains and minimises
    counts = lm.parameter_counts()  # of the whole model, before expert parallelism keeps a rank's share
    schedule = objective.flops_schedule(tc.seq_len, device_type())  # training FLOPs per token from each step on
    costs = StepCosts(schedule, tc.batch_size * tc.seq_len)
    budget_line = set_steps_from_budget(cfg, costs)
    train_flops = costs.flops_through(tc.max_steps)
    if budget_line:
        check_steps(cfg)
    layout = apply_parallel(lm, tc, state, "cuda" if use_cuda else "cpu", cfg.objective, micro)

    # DDP searches the graph for parameters without gradients only where some can have none.
    find_unused = lm.may_leave_parameters_unused or objective.may_leave_parameters_unused
    accelerator = Accelerator(
        cpu=not use_cuda, mixed_precision="bf16" if (use_cuda and tc.bf16) else "no",
        log_with="wandb" if cfg.logger.name == "wandb" else None,
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=find_unused)])
    optimizer = build_optimizer(lm, cfg.optimizer, tc.lr, accelerator.distributed_type)
    scheduler = build_scheduler(optimizer, tc)
    model = objective.module  # what the loop forwards
    model = torch.compile(model) if (use_cuda and tc.compile) else model
    model, optimizer = accelerator.prepare(model, optimizer)
    optimizers = torch_optimizers(optimizer.optimizer)  # the torch optimizers inside, whose state is checkpointed
    # The scheduler is not prepared: Accelerate would step it once per process.

    resume_from = ckpt.resolve_resume_on_main(accelerator, cfg.resume, run_dir)
    resumed_step = ckpt.trainer_state(resume_from)["step"] if resume_from is not None else 0
    phase_ends = objective.phase_ends(tc.max_steps)
    if resume_from is not None:
        objective.begin_step(resumed_step - 1)  # its optimizer state is of that step's phase
    run = Run(cfg=cfg, accelerator=accelerator, run_dir=run_dir, data=data, lm=lm, model=model, objective=objective,
              optimizer=optimizer, optimizers=optimizers,
              scheduler=scheduler, micro=layout.micro, costs=costs, phase_ends=phase_ends, step=0, t_origin=t_start,
              last_ckpt=None, expert_mesh=layout.expert_mesh, context=layout.context, share=layout.share)
    if resume_from is not None:
        saved = ckpt.load_checkpoint(resume_from, lm, run.optimizers, scheduler, layout.expert_mesh)
        run.step, run.last_ckpt = saved["step"], resume_from
        run.t_origin -= saved["elapsed"]  # time/elapsed continues from where the checkpoint left off
        accelerator.print(f"resumed from {resume_from} at step {run.step}"
                          + (f" (saved by {saved['processes']} process(es), now {world})" if saved["processes"] != world else ""))

    # Written once everything that can fail on bad input has run: a run that fails before leaves no files.
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    accelerator.wait_for_everyone()
    group = None
    if cfg.logger.name == "wandb":
        from runs.tracking import init_run, wandb_group

        init_run(accelerator, cfg, run_dir, counts)
        group = wandb_group(cfg)
    if accelerator.is_main_process:
        (run_dir / "run_info.json").write_text(json.dumps({
            "name": cfg.name, "params": counts, "layer_mixers": lm.config.layer_mixers,
            "layer_ffns": lm.config.layer_ffns, "size": cfg.model.size, "seq_len": tc.seq_len,
            "train_flops_per_token": train_flops / (tc.max_steps * run.tokens_per_step),  # mean
            "max_steps": tc.max_steps, "train_flops": train_flops, "processes": world,
            "expert_parallel": tc.expert_parallel, "context_parallel": tc.context_parallel,
            "distributed_type": accelerator.distributed_type.value, "device": str(accelerator.device),
            "ddp_find_unused_parameters": getattr(model, "find_unused_parameters", None),
            "data": cfg.data.name, "data_info": data.info, "group": group}, indent=1))
    accelerator.print(
        f"run_dir {run_dir} | {counts['total'] / 1e6:.2f}M params ({counts['active'] / 1e6:.2f}M active) | "
        f"layers {lm.config.layer_mixers} x {lm.config.layer_ffns} | {len(data.train)} train / "
        f"{len(data.val)} val sequences of {tc.seq_len} | {world} process(es) on {accelerator.device}"
        + (f" ({layout.share.size} data replica(s) x {tc.context_parallel} context ranks, {tc.seq_len // tc.context_parallel} "
           f"tokens of each sequence per rank)" if layout.context is not None else ""))
    if budget_line:
        accelerator.print(budget_line)
    if plan := objective.describe(tc.max_steps):
        accelerator.print(plan)
    return run
