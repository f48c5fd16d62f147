"""Train a decoder LM: python train.py [group=choice ...] [key=value ...]

Builds data, model, optimizer from the Hydra config (configs/train.yaml), runs the loop on
Accelerate (one CPU/GPU process, or DDP/FSDP under `accelerate launch`), logs to metrics.jsonl and
W&B, checkpoints, and exports <run_dir>/final as an HF model directory.
"""
import json
import math
import os
import resource
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from training.config import check_group_overrides, lm_config, register_resolvers

register_resolvers()


def global_batch(step: int, num_blocks: int, batch_size: int, seed: int) -> torch.Tensor:
    """Indices of the sequences of optimizer step `step`: epoch-wise seeded permutations, so the data
    position is the step itself (resume and any process count see the same batches)."""
    per_epoch = num_blocks // batch_size
    if per_epoch == 0:
        raise ValueError(f"trainer.batch_size={batch_size} exceeds the {num_blocks} training sequences")
    epoch, pos = divmod(step, per_epoch)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return perm[pos * batch_size:(pos + 1) * batch_size]


class StopFlag:
    """SIGINT/SIGTERM set a flag; the loop checkpoints and exits after the current step."""

    def __init__(self):
        self.signal = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)

    def handle(self, signum, frame):
        self.signal = signal.Signals(signum).name


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


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


def train(cfg: DictConfig) -> float:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, broadcast_object_list, set_seed
    from hydra.core.hydra_config import HydraConfig
    from tqdm.auto import tqdm

    from data import build_data
    from model import DecoderLM
    from scripts.moe_report import plot_moe_load
    from training import checkpoint as ckpt
    from training.evaluation import evaluate_split, sample, summarize
    from training.metrics import MetricsWriter, perplexity, plot_loss_curves, wandb_mode
    from training.optim import build_optimizer, build_scheduler
    from training.perf import device_peak_flops

    t_start = time.time()
    tc = cfg.trainer
    use_cuda = torch.cuda.is_available()
    accelerator = Accelerator(
        cpu=not use_cuda,
        mixed_precision="bf16" if (use_cuda and tc.bf16) else "no",
        log_with="wandb" if cfg.logger.name == "wandb" else None,
        # MoE experts that get no tokens in a micro-batch, and frozen/stage-dependent DSA paths, leave
        # parameters without gradients on some ranks; DDP must not wait for them.
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
    )
    world, rank = accelerator.num_processes, accelerator.process_index
    micro = tc.batch_size // (world * tc.grad_accum)
    if micro * world * tc.grad_accum != tc.batch_size:
        raise ValueError(f"trainer.batch_size={tc.batch_size} is not divisible by processes ({world}) x grad_accum ({tc.grad_accum})")

    # One run directory for all ranks: the main process's.
    run_dir = [cfg.run_dir or HydraConfig.get().runtime.output_dir]
    broadcast_object_list(run_dir)
    run_dir = Path(run_dir[0])
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    set_seed(cfg.seed)

    # Data: built on the main process first so the tokenizer/token caches are written once.
    with accelerator.main_process_first():
        data = build_data(cfg.data, tc.seq_len, cfg.seed)
    eos = data.tokenizer.eos_token_id if data.tokenizer is not None else None
    model = DecoderLM(lm_config(cfg, data.vocab_size, eos))
    if tc.seq_len > model.config.max_position_embeddings:
        raise ValueError(f"trainer.seq_len={tc.seq_len} exceeds model.max_position_embeddings={model.config.max_position_embeddings}")
    if cfg.init_from:
        report = ckpt.load_matching_weights(model, cfg.init_from)
        accelerator.print(f"init_from {cfg.init_from}: loaded {len(report['loaded'])} tensors; "
                          f"new: {report['new'] or 'none'}; unused: {report['unused'] or 'none'}; "
                          f"shape mismatch: {report['shape_mismatch'] or 'none'}")
    if tc.trainable:
        for name, p in model.named_parameters():
            p.requires_grad_(any(s in name for s in tc.trainable))
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(f"trainer.trainable={list(tc.trainable)} matches no parameter name")
    counts = model.parameter_counts()
    flops_per_token = 3 * model.flops_per_token(tc.seq_len)  # forward + backward
    peak = device_peak_flops(accelerator.device, bf16=accelerator.mixed_precision == "bf16")

    optimizer = build_optimizer(model, cfg.optimizer, tc.lr, accelerator.distributed_type)
    scheduler = build_scheduler(optimizer, tc)
    if use_cuda and tc.compile:
        model = torch.compile(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    # Not prepared: Accelerate would step it once per process; we step it once per optimizer step.
    accelerator.register_for_checkpointing(scheduler)
    unwrapped = accelerator.unwrap_model(model)

    tracker = cfg.logger.name == "wandb"
    if tracker:
        mode = wandb_mode(cfg.logger.mode)
        arch = {"attention": OmegaConf.to_container(cfg.model.attention) if cfg.model.attention else cfg.attention.name,
                "ffn": OmegaConf.to_container(cfg.model.ffn) if cfg.model.ffn else cfg.ffn.name, "size": cfg.model.size}
        accelerator.init_trackers(
            cfg.logger.project,
            config={**OmegaConf.to_container(cfg, resolve=True), "params": counts, "arch": arch},
            init_kwargs={"wandb": {"name": f"{cfg.name}-{run_dir.name}", "group": cfg.logger.group,
                                   "tags": [str(arch["attention"]), str(arch["ffn"]), str(arch["size"]), *cfg.logger.tags],
                                   "dir": str(run_dir), "mode": mode}},
        )
    metrics = MetricsWriter(accelerator, run_dir, tracker)
    if accelerator.is_main_process:
        (run_dir / "run_info.json").write_text(json.dumps({
            "name": cfg.name, "params": counts, "layer_mixers": model.config.layer_mixers,
            "layer_ffns": model.config.layer_ffns, "size": cfg.model.size, "seq_len": tc.seq_len,
            "train_flops_per_token": flops_per_token, "processes": world, "device": str(accelerator.device),
            "data": cfg.data.name, "data_info": data.info, "group": cfg.logger.get("group")}, indent=1))

    step = 0
    t_origin = t_start
    resume_from = ckpt.resolve_resume(cfg.resume, run_dir)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        state = json.loads((resume_from / "trainer_state.json").read_text())
        step = state["step"]
        t_origin -= state["elapsed"]  # time/elapsed continues from where the checkpoint left off
        accelerator.print(f"resumed from {resume_from} at step {step}")
    last_ckpt = resume_from
    tokens_per_step = tc.batch_size * tc.seq_len
    accelerator.print(
        f"run_dir {run_dir} | {counts['total'] / 1e6:.2f}M params ({counts['active'] / 1e6:.2f}M active) | "
        f"layers {model.config.layer_mixers} x {model.config.layer_ffns} | {len(data.train)} train / "
        f"{len(data.val)} val sequences of {tc.seq_len} | {world} process(es) on {accelerator.device}")

    def run_eval() -> dict:
        r = evaluate_split(unwrapped, data.val, micro * tc.grad_accum, tc.eval_batches, accelerator.device,
                           data.bytes_per_token, rank, world, accelerator.autocast)
        sums = accelerator.reduce(torch.stack([r["loss_sum"], r["count"]]), reduction="sum")
        out = summarize(sums[0].item(), sums[1].item(), data.bytes_per_token)
        out.update({f"val/{k}": v for k, v in r["aux"].items()})
        if data.extra_eval is not None:
            out.update(data.extra_eval(unwrapped, accelerator.device))
        return out

    stop = StopFlag()
    bar = tqdm(total=tc.max_steps, initial=step, disable=not accelerator.is_main_process, dynamic_ncols=True)
    window = {"loss": 0.0, "steps": 0, "time": 0.0, "aux": {}}
    model.train()
    while step < tc.max_steps:
        t0 = time.perf_counter()
        idx = global_batch(step, len(data.train), tc.batch_size, cfg.seed)
        step_loss = torch.zeros((), device=accelerator.device)
        step_aux = {}
        for m in range(tc.grad_accum):
            shard = idx[(m * world + rank) * micro:(m * world + rank + 1) * micro]
            batch = {k: v.to(accelerator.device) for k, v in data.train.batch(shard).items()}
            sync = m == tc.grad_accum - 1
            with (nullcontext() if sync else accelerator.no_sync(model)), accelerator.autocast():
                out = model(**batch)
            accelerator.backward(out.loss / tc.grad_accum)
            step_loss += out.lm_loss.detach() / tc.grad_accum
            for k, v in out.aux_metrics.items():
                step_aux[k] = step_aux.get(k, 0) + v / tc.grad_accum
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), tc.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        for module in unwrapped.modules():
            if hasattr(module, "after_optimizer_step"):
                module.after_optimizer_step()
        step += 1
        loss = accelerator.reduce(step_loss, reduction="mean").item()
        if not math.isfinite(loss):
            accelerator.print(f"error: loss became non-finite ({loss}) at step {step}; stopping. "
                              f"Last good checkpoint: {last_ckpt or 'none'}")
            accelerator.end_training()
            sys.exit(1)
        dt = time.perf_counter() - t0
        window["loss"] += loss
        window["steps"] += 1
        window["time"] += dt
        for k, v in step_aux.items():
            window["aux"][k] = window["aux"].get(k, 0) + v
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}")

        log = {}
        if step % tc.log_every == 0 or step == tc.max_steps:
            n = window["steps"]
            tok_s = tokens_per_step * n / window["time"]
            log.update({
                "train/loss": window["loss"] / n, "train/ppl": perplexity(window["loss"] / n),
                "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                "perf/tokens_per_sec": tok_s, "perf/step_time": window["time"] / n,
                "perf/tflops": flops_per_token * tok_s / 1e12,
                "perf/peak_mem_gb": peak_memory_gb(accelerator.device), "tokens_seen": step * tokens_per_step,
                "time/elapsed": time.time() - t_origin,
                **{k: v / n for k, v in window["aux"].items()},
            })
            if peak:
                log["perf/mfu"] = flops_per_token * tok_s / (peak * world)
            window = {"loss": 0.0, "steps": 0, "time": 0.0, "aux": {}}
        if step % tc.eval_every == 0 or step == tc.max_steps:
            log.update(run_eval())
            log["tokens_seen"] = step * tokens_per_step
            bar.write(f"step {step}: val loss {log['val/loss']:.4f}" +
                      (f", bpb {log['val/bpb']:.4f}" if "val/bpb" in log else ""))
        if log:
            metrics.log(log, step)
        stopping = accelerator.reduce(torch.tensor(float(stop.signal is not None), device=accelerator.device),
                                      reduction="sum").item() > 0 if world > 1 else stop.signal is not None
        if (step % tc.ckpt_every == 0 and step < tc.max_steps) or stopping:
            last_ckpt = ckpt.save_checkpoint(accelerator, run_dir, {"step": step, "tokens_seen": step * tokens_per_step,
                                                                        "elapsed": time.time() - t_origin},
                                             tc.keep_checkpoints)
        if stopping:
            accelerator.print(f"\n{stop.signal or 'stop signal'}: saved {last_ckpt} at step {step}; "
                              f"continue with run_dir={run_dir} resume=auto")
            accelerator.end_training()
            return float("nan")
    bar.close()

    final_metrics = run_eval() if step % tc.eval_every else {k: v for k, v in log.items() if k.startswith("val/")}
    if accelerator.is_main_process:
        export_final(unwrapped, data, cfg, run_dir)
        plot_loss_curves(run_dir)
        plot_moe_load(run_dir)  # no-op without MoE layers
        lines = [f"val loss {final_metrics['val/loss']:.4f} | ppl {final_metrics['val/ppl']:.2f}"
                 + (f" | bpb {final_metrics['val/bpb']:.4f}" if "val/bpb" in final_metrics else "")]
        lines += [f"{k} {v:.4f}" for k, v in final_metrics.items() if not k.startswith(("val/loss", "val/ppl", "val/bpb"))
                  and isinstance(v, float)]
        if data.tokenizer is not None and tc.sample_tokens:
            s = sample(unwrapped, data.tokenizer, tc.sample_prompt, tc.sample_tokens, cfg.seed, accelerator.device,
                       temperature=tc.sample_temperature, top_p=tc.sample_top_p, repetition_penalty=tc.sample_repetition_penalty)
            lines.append(f"sample ({s['decode_tokens_per_sec']:.0f} tok/s decode):\n{s['text']}")
        lines.append(f"saved {run_dir / 'final'} | wall time {time.time() - t_start:.0f}s")
        print("\n" + "\n".join(lines))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return final_metrics["val/loss"]


def export_final(model, data, cfg, run_dir: Path) -> None:
    """<run_dir>/final: safetensors + config (+ tokenizer) + the training config, written to a temp
    dir and renamed, so a crash never leaves a half-written export."""
    final = run_dir / "final"
    tmp = run_dir / ".tmp_final"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if data.tokenizer is not None:
        data.tokenizer.save_pretrained(tmp)
    (tmp / "training_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


if __name__ == "__main__":
    check_group_overrides(sys.argv[1:])
    main()
