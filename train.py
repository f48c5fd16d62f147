"""Train a decoder LM: python train.py [group=choice ...] [key=value ...]

training/run.py's setup() builds the Run (data, model, optimizer, trackers, resume) from the
Hydra config (configs/train.yaml) on Accelerate (one CPU/GPU process, or DDP/FSDP under
`accelerate launch`); train() runs the loop (train_step, the logging Meter, evaluate, checkpoints, stop signals);
finish() evaluates, exports <run_dir>/final as an HF model directory, plots and samples.
"""
import math
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from training.config import check_group_overrides, register_hydra, resolve_aliases
from training.run import Run, setup

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
        return train(checked_config(cfg, HydraConfig.get().overrides.task))
    except (ValueError, FileNotFoundError) as e:  # configuration and input errors: one line, no traceback,
        remove_hydra_only_dir(Path(HydraConfig.get().runtime.output_dir))  # and no run dir left behind
        message = f"error: {e}"
    except SystemExit as e:  # non-finite loss: already reported
        if not (multirun and e.code):
            raise
        message = f"error: job exited with status {e.code}"
    if multirun:
        print(message, file=sys.stderr)
        raise JobFailed(message)
    sys.exit(message)


def checked_config(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """The config to train with: on resume, the run's saved config with what may change on resume
    (training/config.py config_for_resume); for a new run with a budget, max_steps left for the budget
    to set (training/budget.py); every value checked (training/validation.py)."""
    from training.budget import budget_replaces_steps
    from training.config import config_for_resume, saved_config_path
    from training.validation import check_train_config

    saved = saved_config_path(cfg.resume, cfg.run_dir) if cfg.resume and (cfg.run_dir or cfg.resume != "auto") else None
    if saved is not None:
        cfg = config_for_resume(cfg, OmegaConf.load(saved), overrides, saved)
    else:
        budget_replaces_steps(cfg, overrides)
    check_train_config(cfg)
    return cfg


def remove_hydra_only_dir(folder: Path) -> None:
    """Hydra's run dir of a job that failed before starting, if it holds only what Hydra wrote, and the
    folders Hydra made for it below the working directory (outputs/<date>/) that are left empty."""
    import shutil

    if folder.is_dir() and {p.name for p in folder.iterdir()} <= {".hydra", "train.log"}:
        shutil.rmtree(folder)
        cwd = Path.cwd().resolve()
        for parent in folder.resolve().parents:
            if parent == cwd or not parent.is_relative_to(cwd) or any(parent.iterdir()):
                break
            parent.rmdir()


def train_step(run: Run) -> tuple[float, dict, float]:
    """One optimizer step over the global batch of step `run.step`: this process's micro-batches,
    gradient sync on the last one. Returns the mean LM loss over all processes, the aux metrics and
    the gradient norm before clipping."""
    from contextlib import nullcontext

    from data.batches import global_batch, micro_batches

    a, tc = run.accelerator, run.cfg.trainer
    if run.linearization is not None:
        from training.linearize import stage_at

        run.linearization.set_stage(stage_at(run.step, run.cfg.linearize))
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
    if run.expert_mesh is None:
        grad_norm = a.clip_grad_norm_(run.model.parameters(), tc.grad_clip)
    else:  # expert shards: their gradients reduced over data replicas, their norm over the expert ranks
        from training.parallel import reduce_and_clip_gradients, step_metrics

        grad_norm = reduce_and_clip_gradients(run.lm, run.expert_mesh, tc.grad_clip)
        aux.update(step_metrics(run.lm, a.device))
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
    """Val loss / ppl / bpb over the first eval_batches x batch_size val sequences, whatever the
    process count (every process scores its share, in forwards of its micro-batch size), the number
    of val tokens scored, and the data's own extra evaluation (MQAR accuracy). A model whose MoE
    router is not causal (expert_choice, balanced) is scored twice: val/ with token-choice routing,
    val/batch_routing/ with its training routing over each evaluation forward's batch."""
    from model.ffn.moe import batch_routing_at_eval
    from training.evaluation import batch_routing_scores, evaluate_split, summarize

    a, tc = run.accelerator, run.cfg.trainer
    sequences = None if tc.eval_batches is None else tc.eval_batches * tc.batch_size
    r = evaluate_split(run.lm, run.data.val, run.micro, sequences, a.device,
                       run.data.bytes_per_token, a.process_index, a.num_processes, a.autocast)
    sums = a.reduce(torch.stack([r["loss_sum"], r["count"]]), reduction="sum")
    out = summarize(sums[0].item(), sums[1].item(), run.data.bytes_per_token)
    out["val/tokens"] = int(sums[1].item())
    # r["aux"] holds this rank's means over its forwards: the mean over all ranks weights each by its tokens
    aux = a.reduce({k: v * r["count"] for k, v in r["aux"].items()}, reduction="sum")
    out.update({f"val/{k}": v / sums[1] for k, v in aux.items()})
    with batch_routing_at_eval(run.lm) as batch_routed:
        if batch_routed:  # expert_choice / balanced: the same sequences routed as in training (not causal)
            r = evaluate_split(run.lm, run.data.val, run.micro, sequences, a.device,
                               run.data.bytes_per_token, a.process_index, a.num_processes, a.autocast)
            sums = a.reduce(torch.stack([r["loss_sum"], r["count"]]), reduction="sum")
            out.update(batch_routing_scores(summarize(sums[0].item(), sums[1].item(), run.data.bytes_per_token)))
    if run.data.extra_eval is not None:
        out.update(run.data.extra_eval(run.lm, a.device))
    return out


def save(run: Run) -> None:
    from training.checkpoint import save_checkpoint

    state = {"step": run.step, "tokens_seen": run.step * run.tokens_per_step, "elapsed": time.time() - run.t_origin,
             "processes": run.accelerator.num_processes}
    run.last_ckpt = save_checkpoint(run.run_dir, run.lm, run.optimizers, run.scheduler, state,
                                    run.cfg.trainer.keep_checkpoints, run.data.tokenizer, OmegaConf.to_yaml(run.cfg, resolve=True),
                                    run.expert_mesh)


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
    stage_ends = {}  # {step: the stage that ends there}: logged and evaluated there
    if run.linearization is not None:
        from training import linearize

        stage_ends = linearize.stage_ends(cfg.linearize, tc.max_steps)
        if run.step == 0:  # the student as it starts: the teacher's weights, its own mixers (zero-shot)
            zero_shot = evaluate(run)
            metrics.log({**zero_shot, "tokens_seen": 0, "flops_seen": 0}, 0)
            a.print(f"step 0 (zero-shot): val loss {zero_shot['val/loss']:.4f}"
                    + (f", bpb {zero_shot['val/bpb']:.4f}" if "val/bpb" in zero_shot else ""))
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
        if step % tc.log_every == 0 or last or step in stage_ends:  # a logging window holds one stage
            log.update(window_log(run, meter, grad_norm, contention, bar))
        if step % tc.eval_every == 0 or last or step in stage_ends:
            log.update(evaluate(run))
            if a.is_main_process:
                bar.write(f"step {step}" + (f" (end of {stage_ends[step]})" if step in stage_ends else "")
                          + f": val loss {log['val/loss']:.4f}" + (f", bpb {log['val/bpb']:.4f}" if "val/bpb" in log else ""))
        if log:
            tokens = step * run.tokens_per_step  # and training FLOPs so far, the x-axis of an equal-compute comparison
            metrics.log({**log, "tokens_seen": tokens, "flops_seen": tokens * run.flops_per_token}, step)
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
    folder = export_final(run.lm, run.data.tokenizer, OmegaConf.to_yaml(cfg, resolve=True), run.run_dir, run.expert_mesh)
    if a.is_main_process:
        plots = [p for p in [plot_loss_curves(run.run_dir), *plot_moe_load(run.run_dir)] if p]  # MoE: heatmap, imbalance
        if cfg.logger.name == "wandb":
            from training.tracking import finish_run

            finish_run(a, run.run_dir, run.lm.parameter_counts(), time.time() - run.t_origin, plots)
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
    if {"-m", "--multirun"} & set(sys.argv):  # every job checked before Hydra launches the first
        from training.jobs import check_multirun

        try:
            check_multirun([a for a in sys.argv[1:] if not a.startswith("-")])
        except ValueError as e:
            sys.exit(f"error: {e}")
    main()
