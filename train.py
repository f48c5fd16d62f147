"""Train a decoder LM: python train.py [group=choice ...] [key=value ...]

setup() builds data, model, optimizer and trackers from the Hydra config (configs/train.yaml) on
Accelerate (one CPU/GPU process, or DDP/FSDP under `accelerate launch`) and resumes if asked;
train() runs the loop (train_step, the logging Meter, evaluate, checkpoints, stop signals);
finish() evaluates, exports <run_dir>/final as an HF model directory, plots and samples.
"""
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from training.config import check_group_overrides, lm_config, register_hydra, resolve_aliases

register_hydra()


class JobFailed(RuntimeError):
    """A failed job of a -m sweep: Hydra's launcher records it and starts the next job (a SystemExit
    would end the whole sweep); the sweep exits with status 1 at the end."""


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        return train(cfg)
    except (ValueError, FileNotFoundError) as e:  # configuration and input errors: one line, no traceback
        message = f"error: {e}"
    except SystemExit as e:  # non-finite loss: already reported
        if not (multirun and e.code):
            raise
        message = f"error: job exited with status {e.code}"
    if multirun:
        print(message, file=sys.stderr)
        raise JobFailed(message)
    sys.exit(message)


@dataclass
class Run:
    """What the loop needs: the config, Accelerate, data, the model (`lm` is the DecoderLM itself,
    `model` what Accelerate prepared around it), the optimizer (as prepared; `optimizers` are the
    torch optimizers inside it, whose state is checkpointed), and where the run stands."""
    cfg: DictConfig
    accelerator: object
    run_dir: Path
    data: object
    lm: object
    model: object
    optimizer: object
    optimizers: list
    scheduler: object
    micro: int             # sequences per process per micro-step
    flops_per_token: float  # training (forward + backward)
    peak: object           # training.perf.Peak of one device (MFU = achieved per device / peak.flops)
    step: int
    t_origin: float        # time/elapsed counts from here (moved back on resume)
    last_ckpt: Path | None

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.trainer.batch_size * self.cfg.trainer.seq_len


def setup(cfg: DictConfig) -> Run:
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedDataParallelKwargs, broadcast_object_list, set_seed
    from hydra.core.hydra_config import HydraConfig

    from data import build_data
    from model import DecoderLM
    from training import checkpoint as ckpt
    from training.metrics import init_wandb
    from training.optim import build_optimizer, build_scheduler, torch_optimizers
    from training.perf import device_peak

    t_start = time.time()
    tc = cfg.trainer
    use_cuda = torch.cuda.is_available()
    state = PartialState(cpu=not use_cuda)
    world = state.num_processes
    micro = tc.batch_size // (world * tc.grad_accum)
    if micro * world * tc.grad_accum != tc.batch_size:
        raise ValueError(f"trainer.batch_size={tc.batch_size} is not divisible by processes ({world}) x grad_accum ({tc.grad_accum})")

    # One run directory for all ranks: the main process's.
    run_dir = [cfg.run_dir or HydraConfig.get().runtime.output_dir]
    broadcast_object_list(run_dir)
    run_dir = Path(run_dir[0])
    if state.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    set_seed(cfg.seed)

    # Data: prepared by one process first, so the tokenizer/token caches are written once: the
    # main process when the cache is one filesystem for all nodes, else each node's local main.
    with state.main_process_first() if cfg.data.get("cache_shared") else state.local_main_process_first():
        data = build_data(cfg.data, tc.seq_len, cfg.seed)
    eos = data.tokenizer.eos_token_id if data.tokenizer is not None else None
    lm = DecoderLM(lm_config(cfg, data.vocab_size, eos))
    if tc.seq_len > lm.config.max_position_embeddings:
        raise ValueError(f"trainer.seq_len={tc.seq_len} exceeds model.max_position_embeddings={lm.config.max_position_embeddings}")
    if cfg.init_from:
        report = ckpt.load_matching_weights(lm, cfg.init_from)
        state.print(f"init_from {cfg.init_from}: loaded {len(report['loaded'])} tensors; "
                    f"new: {report['new'] or 'none'}; unused: {report['unused'] or 'none'}; "
                    f"shape mismatch: {report['shape_mismatch'] or 'none'}")
    if tc.trainable:
        for name, p in lm.named_parameters():
            p.requires_grad_(any(s in name for s in tc.trainable))
        if not any(p.requires_grad for p in lm.parameters()):
            raise ValueError(f"trainer.trainable={list(tc.trainable)} matches no parameter name")

    # DDP searches the graph for parameters without gradients only where some can have none.
    find_unused = lm.leaves_parameters_unused() or bool(tc.trainable)
    accelerator = Accelerator(
        cpu=not use_cuda, mixed_precision="bf16" if (use_cuda and tc.bf16) else "no",
        log_with="wandb" if cfg.logger.name == "wandb" else None,
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=find_unused)])
    optimizer = build_optimizer(lm, cfg.optimizer, tc.lr, accelerator.distributed_type)
    scheduler = build_scheduler(optimizer, tc)
    model = torch.compile(lm) if (use_cuda and tc.compile) else lm
    model, optimizer = accelerator.prepare(model, optimizer)
    # The scheduler is not prepared: Accelerate would step it once per process.

    counts = lm.parameter_counts()
    if cfg.logger.name == "wandb":
        init_wandb(accelerator, cfg, run_dir, counts)
    if accelerator.is_main_process:
        (run_dir / "run_info.json").write_text(json.dumps({
            "name": cfg.name, "params": counts, "layer_mixers": lm.config.layer_mixers,
            "layer_ffns": lm.config.layer_ffns, "size": cfg.model.size, "seq_len": tc.seq_len,
            "train_flops_per_token": 3 * lm.flops_per_token(tc.seq_len), "processes": world,
            "distributed_type": accelerator.distributed_type.value, "device": str(accelerator.device),
            "ddp_find_unused_parameters": getattr(model, "find_unused_parameters", None),
            "data": cfg.data.name, "data_info": data.info, "group": cfg.logger.get("group")}, indent=1))

    run = Run(cfg=cfg, accelerator=accelerator, run_dir=run_dir, data=data, lm=lm, model=model,
              optimizer=optimizer, optimizers=torch_optimizers(optimizer.optimizer),
              scheduler=scheduler, micro=micro,
              flops_per_token=3 * lm.flops_per_token(tc.seq_len),
              peak=device_peak(accelerator.device, bf16=accelerator.mixed_precision == "bf16"),
              step=0, t_origin=t_start, last_ckpt=None)
    resume_from = ckpt.resolve_resume_on_main(accelerator, cfg.resume, run_dir)
    if resume_from is not None:
        saved = ckpt.load_checkpoint(resume_from, lm, run.optimizers, scheduler)
        run.step, run.last_ckpt = saved["step"], resume_from
        run.t_origin -= saved["elapsed"]  # time/elapsed continues from where the checkpoint left off
        accelerator.print(f"resumed from {resume_from} at step {run.step}"
                          + (f" (saved by {saved['processes']} process(es), now {world})" if saved["processes"] != world else ""))
    accelerator.print(
        f"run_dir {run_dir} | {counts['total'] / 1e6:.2f}M params ({counts['active'] / 1e6:.2f}M active) | "
        f"layers {lm.config.layer_mixers} x {lm.config.layer_ffns} | {len(data.train)} train / "
        f"{len(data.val)} val sequences of {tc.seq_len} | {world} process(es) on {accelerator.device}")
    accelerator.print(run.peak.describe())
    return run


def train_step(run: Run) -> tuple[float, dict, float]:
    """One optimizer step over the global batch of step `run.step`: this process's micro-batches,
    gradient sync on the last one. Returns the mean LM loss over all processes, the aux metrics and
    the gradient norm before clipping."""
    from contextlib import nullcontext

    from data.batches import global_batch, micro_batches

    a, tc = run.accelerator, run.cfg.trainer
    indices = global_batch(run.step, len(run.data.train), tc.batch_size, run.cfg.seed)
    step_loss = torch.zeros((), device=a.device)
    aux = {}
    for m, shard in enumerate(micro_batches(indices, tc.grad_accum, a.process_index, a.num_processes)):
        batch = {k: v.to(a.device) for k, v in run.data.train.batch(shard).items()}
        with (nullcontext() if m == tc.grad_accum - 1 else a.no_sync(run.model)), a.autocast():
            out = run.model(**batch)
        a.backward(out.loss / tc.grad_accum)
        step_loss += out.lm_loss.detach() / tc.grad_accum
        for k, v in out.aux_metrics.items():
            aux[k] = aux.get(k, 0) + v / tc.grad_accum
    grad_norm = a.clip_grad_norm_(run.model.parameters(), tc.grad_clip)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    for module in run.lm.modules():
        if hasattr(module, "after_optimizer_step"):
            module.after_optimizer_step()
    run.step += 1
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
        grad_norm = grad_norm.full_tensor()
    return a.reduce(step_loss, reduction="mean").item(), aux, float(grad_norm)


def evaluate(run: Run) -> dict:
    """Val loss / ppl / bpb over the first eval_batches (every process evaluates its share) and the
    data's own extra evaluation (MQAR accuracy)."""
    from training.evaluation import evaluate_split, summarize

    a, tc = run.accelerator, run.cfg.trainer
    r = evaluate_split(run.lm, run.data.val, run.micro * tc.grad_accum, tc.eval_batches, a.device,
                       run.data.bytes_per_token, a.process_index, a.num_processes, a.autocast)
    sums = a.reduce(torch.stack([r["loss_sum"], r["count"]]), reduction="sum")
    out = summarize(sums[0].item(), sums[1].item(), run.data.bytes_per_token)
    out.update({f"val/{k}": v for k, v in r["aux"].items()})
    if run.data.extra_eval is not None:
        out.update(run.data.extra_eval(run.lm, a.device))
    return out


def save(run: Run) -> None:
    from training.checkpoint import save_checkpoint

    state = {"step": run.step, "tokens_seen": run.step * run.tokens_per_step, "elapsed": time.time() - run.t_origin,
             "processes": run.accelerator.num_processes}
    run.last_ckpt = save_checkpoint(run.run_dir, run.lm, run.optimizers, run.scheduler, state,
                                    run.cfg.trainer.keep_checkpoints, run.data.tokenizer, OmegaConf.to_yaml(run.cfg, resolve=True))


def train(cfg: DictConfig) -> float:
    from tqdm.auto import tqdm

    from training.checkpoint import StopFlag
    from training.metrics import Meter, MetricsWriter
    from training.perf import ContentionMonitor

    run = setup(cfg)
    a, tc = run.accelerator, cfg.trainer
    metrics = MetricsWriter(a, run.run_dir, cfg.logger.name == "wandb")
    meter, stop, log = Meter(), StopFlag(), {}
    contention = ContentionMonitor() if a.device.type == "cpu" and a.is_main_process else None
    if contention and (warning := contention.check()):
        a.print(warning)
    bar = tqdm(total=tc.max_steps, initial=run.step, disable=not a.is_main_process, dynamic_ncols=True)
    run.model.train()
    while run.step < tc.max_steps:
        t0 = time.perf_counter()
        loss, aux, grad_norm = train_step(run)
        if not math.isfinite(loss):
            a.print(f"error: loss became non-finite ({loss}) at step {run.step}; stopping. "
                    f"Last good checkpoint: {run.last_ckpt or 'none'}")
            a.end_training()
            sys.exit(1)
        seconds = time.perf_counter() - t0
        meter.add(loss, seconds, aux)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{run.tokens_per_step / seconds:,.0f}")

        step, last = run.step, run.step == tc.max_steps
        log = {}
        if step % tc.log_every == 0 or last:
            log.update(window_log(run, meter, grad_norm, contention, bar))
        if step % tc.eval_every == 0 or last:
            log.update(evaluate(run))
            if a.is_main_process:
                bar.write(f"step {step}: val loss {log['val/loss']:.4f}" +
                          (f", bpb {log['val/bpb']:.4f}" if "val/bpb" in log else ""))
        if log:
            metrics.log({**log, "tokens_seen": step * run.tokens_per_step}, step)
        stopping = a.reduce(torch.tensor(float(stop.signal is not None), device=a.device), reduction="sum").item() > 0
        if (step % tc.ckpt_every == 0 and not last) or stopping:
            save(run)
        if stopping:
            a.print(f"\n{stop.signal or 'stop signal'}: saved {run.last_ckpt} at step {step}; "
                    f"continue with run_dir={run.run_dir} resume=auto")
            a.end_training()
            return float("nan")
    bar.close()
    return finish(run, log)


def window_log(run: Run, meter, grad_norm: float, contention, bar) -> dict:
    """The logging window's row (the Meter's loss and throughput), with MFU against the device's
    peak (re-measured if it was exceeded), lr, gradient norm, memory and elapsed time; a CPU
    contention warning, once."""
    from training.perf import peak_memory_gb, recheck_peak

    a = run.accelerator
    log = meter.row(run.tokens_per_step, run.flops_per_token)
    achieved = log["perf/tflops"] * 1e12 / a.num_processes  # per device
    if (peak := recheck_peak(run.peak, achieved)) is not run.peak:
        run.peak = peak
        a.print(peak.describe())
    if run.peak.flops:
        log["perf/mfu"] = achieved / run.peak.flops
    if contention and (warning := contention.after_window(log["perf/tokens_per_sec"])):
        bar.write(warning)
    return {**log, "lr": run.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
            "perf/peak_mem_gb": peak_memory_gb(a.device), "time/elapsed": time.time() - run.t_origin}


def finish(run: Run, last_log: dict) -> float:
    """Final evaluation (unless the last step just ran one), the export (all ranks join the gather),
    then on the main process: plots, the summary, and a sample from the exported model."""
    from training.checkpoint import export_final, load_lm
    from training.evaluation import sample
    from training.plots import plot_loss_curves, plot_moe_load

    a, cfg, tc = run.accelerator, run.cfg, run.cfg.trainer
    final = evaluate(run) if run.step % tc.eval_every else {k: v for k, v in last_log.items() if k.startswith("val/")}
    folder = export_final(run.lm, run.data.tokenizer, OmegaConf.to_yaml(cfg, resolve=True), run.run_dir)
    if a.is_main_process:
        plot_loss_curves(run.run_dir)
        plot_moe_load(run.run_dir)  # no-op without MoE layers
        lines = [f"val loss {final['val/loss']:.4f} | ppl {final['val/ppl']:.2f}"
                 + (f" | bpb {final['val/bpb']:.4f}" if "val/bpb" in final else "")]
        lines += [f"{k} {v:.4f}" for k, v in final.items()
                  if not k.startswith(("val/loss", "val/ppl", "val/bpb")) and isinstance(v, float)]
        if run.data.tokenizer is not None and tc.sample_tokens:
            # From the export, not the training model: under FSDP that one is sharded across ranks,
            # and sampling the export checks it loads.
            exported = load_lm(folder).to(a.device)
            s = sample(exported, run.data.tokenizer, tc.sample_prompt, tc.sample_tokens, cfg.seed, a.device,
                       temperature=tc.sample_temperature, top_p=tc.sample_top_p,
                       repetition_penalty=tc.sample_repetition_penalty)
            lines.append(f"sample ({s['decode_tokens_per_sec']:.0f} tok/s decode):\n{s['text']}")
        lines.append(f"saved {folder} | wall time {time.time() - run.t_origin:.0f}s")
        print("\n" + "\n".join(lines))
    a.wait_for_everyone()
    a.end_training()
    return final["val/loss"]


if __name__ == "__main__":
    check_group_overrides(sys.argv[1:])
    sys.argv[1:] = resolve_aliases(sys.argv[1:])  # attention=... -> mixer=..., before Hydra parses them
    main()
