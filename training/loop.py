"""The training loop: `train(cfg)` sets up the Run (training/run.py), then steps until trainer.max_steps,
logging each window, evaluating and checkpointing on their cadences and at every phase end of the objective
(training/objectives/), and stopping cleanly on SIGINT/SIGTERM with a checkpoint and the command that
resumes; `finish` evaluates, exports <run_dir>/final as an HF model directory, plots and samples."""
import math
import sys
import time
from contextlib import nullcontext

import torch
from omegaconf import DictConfig, OmegaConf

from training.run import Run, setup


def train(cfg: DictConfig) -> float:
    """Train the run the config describes (checked: train.py's checked_config); returns the final val loss
    (NaN when a stop signal ended it early)."""
    from tqdm.auto import tqdm

    from training.checkpoint import StopFlag
    from runs.metrics import MetricsWriter
    from training.metrics import Meter
    from training.perf import ContentionMonitor, device_peak

    run = setup(cfg)
    a, tc = run.accelerator, cfg.trainer
    metrics = MetricsWriter(a, run.run_dir, cfg.logger.name == "wandb", run.step)
    meter, stop, log = Meter(device_peak(a.device, bf16=a.mixed_precision == "bf16")), StopFlag(), {}
    a.print(meter.peak.describe())
    contention = ContentionMonitor() if a.device.type == "cpu" and a.is_main_process else None
    if contention and (warning := contention.check()):
        a.print(warning)
    phase_ends = run.phase_ends  # a logging window holds one phase
    if run.objective.evaluates_at_start and run.step == 0:
        start = evaluate(run)
        metrics.log({**start, **run.objective.start_metrics, "tokens_seen": 0, "flops_seen": 0}, 0)
        a.print(f"step 0 (before training): val loss {start['val/loss']:.4f}"
                + (f", bpb {start['val/bpb']:.4f}" if "val/bpb" in start else ""))
    bar = tqdm(total=tc.max_steps, initial=run.step, disable=not a.is_main_process, dynamic_ncols=True)
    run.model.train()
    while run.step < tc.max_steps:
        t0 = time.perf_counter()
        loss, aux, grad_norm = train_step(run)
        if not math.isfinite(loss):
            bar.close()
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
        if step % tc.log_every == 0 or last or step in phase_ends:  # a logging window holds one phase
            log.update(window_log(run, meter, grad_norm, contention, bar))
        if step % tc.eval_every == 0 or last or step in phase_ends:
            log.update(evaluate(run))
            if a.is_main_process:
                bar.write(f"step {step}" + (f" (end of {phase_ends[step]})" if step in phase_ends else "")
                          + f": val loss {log['val/loss']:.4f}" + (f", bpb {log['val/bpb']:.4f}" if "val/bpb" in log else ""))
        if log:
            tokens = step * run.tokens_per_step  # and training FLOPs so far, the x-axis of an equal-compute comparison
            metrics.log({**log, "tokens_seen": tokens, "flops_seen": run.costs.flops_through(step)}, step)
        stopping = a.reduce(torch.tensor(float(stop.signal is not None), device=a.device), reduction="sum").item() > 0
        if (step % tc.ckpt_every == 0 and not last) or stopping:
            save(run)
        if stopping:
            a.print(f"\n{stop.signal or 'stop signal'}: saved {run.last_ckpt} at step {step}; continue with "
                    f"`python train.py run_dir={run.run_dir} resume=auto` (or the same under `accelerate launch`: "
                    f"any process count resumes; only the steps, cadences and logger may change)")
            a.end_training()
            return float("nan")
    bar.close()
    return finish(run, log, metrics.rows)


def train_step(run: Run) -> tuple[float, dict, float]:
    """One optimizer step over the global batch of step `run.step`: this process's micro-batches,
    gradient sync on the last one. Returns the mean LM loss over all processes, the aux metrics and
    the gradient norm before clipping."""
    from data.batches import global_batch, micro_batches

    a, tc = run.accelerator, run.cfg.trainer
    run.objective.begin_step(run.step)
    indices = global_batch(run.step, len(run.data.train), tc.batch_size, run.cfg.seed)
    step_loss = torch.zeros((), device=a.device)
    aux = {}
    for m, shard in enumerate(micro_batches(indices, tc.grad_accum, run.data_share.rank, run.data_share.size)):
        batch = {k: v.to(a.device) for k, v in run.data.train.batch(shard).items()}
        if run.context is not None:  # whole rows on every rank of the group, each running its slice
            batch["context"] = run.context
        with (nullcontext() if m == tc.grad_accum - 1 else a.no_sync(run.model)), a.autocast():
            out = run.model(**batch)
        a.backward(out.loss / tc.grad_accum)
        step_loss += out.lm_loss.detach() / tc.grad_accum
        for k, v in out.aux_metrics.items():
            aux[k] = aux.get(k, 0) + v / tc.grad_accum
    if run.expert_mesh is None:
        grad_norm = a.clip_grad_norm_(run.model.parameters(), tc.grad_clip)
    else:  # expert shards: their gradients reduced over data replicas, their norm over the expert ranks
        from training.parallel import expert_metrics, reduce_and_clip_gradients

        grad_norm = reduce_and_clip_gradients(run.lm, run.expert_mesh, tc.grad_clip)
        aux.update(expert_metrics(run.lm, a.device))
    if run.context is not None:
        from training.parallel import context_metrics

        aux.update(context_metrics(run.context, a.device))
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    for module in run.lm.modules():
        if hasattr(module, "after_optimizer_step"):
            module.after_optimizer_step()
    run.step += 1
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
        grad_norm = grad_norm.full_tensor()
    return a.reduce(step_loss, reduction="mean").item(), mean_over_processes(a, aux), float(grad_norm)


def mean_over_processes(a, metrics: dict) -> dict:
    """Each aux metric's mean over all processes, in one all-reduce (every process reports the same
    names and shapes): the logged MoE loads and balance statistics then cover the whole global batch,
    as with 1 process and accumulation, not the main process's share."""
    if a.num_processes == 1 or not metrics:
        return metrics
    flat = a.reduce(torch.cat([v.float().flatten() for v in metrics.values()]), reduction="mean")
    return {k: part.view_as(v) for (k, v), part in zip(metrics.items(), flat.split([v.numel() for v in metrics.values()]))}


def evaluate(run: Run) -> dict:
    """evaluation/scoring.py's val scores over the first eval_batches x batch_size val sequences, whatever the
    process count (every data replica scores its share, in forwards of its micro-batch size; under context
    parallelism each rank of a replica its slice of those sequences)."""
    from evaluation.scoring import score_validation

    a, tc = run.accelerator, run.cfg.trainer
    scores = score_validation(run.lm, run.data, run.micro, None if tc.eval_batches is None else tc.eval_batches * tc.batch_size,
                              a.device, rank=run.data_share.rank, world=run.data_share.size, autocast=a.autocast,
                              reduce_sum=lambda x: a.reduce(x, reduction="sum"), context=run.context)
    if run.context is not None:
        run.context.take_sent()  # cp/bytes counts training steps only
    return scores


def save(run: Run) -> None:
    from training.checkpoint import save_checkpoint

    state = {"step": run.step, "tokens_seen": run.step * run.tokens_per_step, "elapsed": time.time() - run.t_origin,
             "processes": run.accelerator.num_processes}
    run.last_ckpt = save_checkpoint(run.run_dir, run.lm, run.optimizers, run.scheduler, state,
                                    run.cfg.trainer.keep_checkpoints, run.data.tokenizer, OmegaConf.to_yaml(run.cfg, resolve=True),
                                    run.expert_mesh)


def window_log(run: Run, meter, grad_norm: float, contention, bar) -> dict:
    """The logging window's row (the Meter's loss and throughput), with MFU against the device's
    peak (re-measured if it was exceeded), lr, gradient norm, memory and elapsed time; a CPU
    contention warning, once."""
    from training.perf import peak_memory_gb, recheck_peak

    a = run.accelerator
    log = meter.row(run.tokens_per_step, run.costs.per_token(run.step - 1))  # a window holds one phase
    achieved = log["perf/tflops"] * 1e12 / a.num_processes  # per device
    if (peak := recheck_peak(meter.peak, achieved)) is not meter.peak:
        meter.peak = peak
        a.print(peak.describe())
    if meter.peak.flops:
        log["perf/mfu"] = achieved / meter.peak.flops
    if contention and (warning := contention.after_window(log["perf/tokens_per_sec"])):
        bar.write(warning)
    return {**log, "lr": run.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
            "perf/peak_mem_gb": peak_memory_gb(a.device), "time/elapsed": time.time() - run.t_origin}


def finish(run: Run, last_log: dict, rows: list[dict]) -> float:
    """Final evaluation (unless the last step just ran one), the export (all ranks join the gather),
    then on the main process: plots (and W&B's summary of the run), and a sample from the exported model."""
    from evaluation.samples import sample
    from runs.checkpoint import load_lm
    from runs.plots import plot_run
    from training.checkpoint import export_final

    a, cfg, tc = run.accelerator, run.cfg, run.cfg.trainer
    final = evaluate(run) if run.step % tc.eval_every else {k: v for k, v in last_log.items() if k.startswith("val/")}
    folder = export_final(run.lm, run.data.tokenizer, OmegaConf.to_yaml(cfg, resolve=True), run.run_dir, run.expert_mesh)
    if a.is_main_process:
        plots = plot_run(run.run_dir, rows)
        if cfg.logger.name == "wandb":
            from runs.tracking import finish_run

            finish_run(a, rows, run.lm.parameter_counts(), time.time() - run.t_origin, plots)
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
