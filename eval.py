"""Evaluate a checkpoint: python eval.py checkpoint=<run dir | final/ | checkpoints/step_N> [key=value ...]

Loss, perplexity and bits per byte on the val split the model was trained on (or `data=...`), the
loss by position (a PNG), generation samples with decode tokens/s, and lm-evaluation-harness tasks
(`tasks=[lambada_openai,hellaswag]`, with requirements-eval.txt installed), and the suites
`suite=[length,recall,decode]` (training/suites.py: loss past the training length, passkey or MQAR
recall, decode speed, memory and cache bytes against the context, each with a PNG). Results go to
<model dir>/eval/eval.json (and the PNG), and into the training run's W&B run, if it had one, under
eval/ (eval/step_N/ for a mid-run checkpoint). scripts/compare.py shows them as columns. A MoE whose
router is not causal (expert_choice, balanced) is also scored with its training routing over each
forward's batch: val/batch_routing/... beside the token-choice val/... (docs/moe.md).
Options: configs/eval.yaml.
"""
import json
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(cfg: DictConfig) -> None:
    try:
        evaluate(cfg)
    except (ValueError, FileNotFoundError) as e:  # configuration and input errors: one line, no traceback
        sys.exit(f"error: {e}")


def evaluate(cfg: DictConfig) -> dict:
    from common.files import written_then_renamed
    from data import build_data
    from training.checkpoint import load_lm, weights_dir
    from training.validation import check_eval_config
    from model.ffn.moe import batch_routing_at_eval
    from training.evaluation import (batch_routing_scores, evaluate_split, lm_eval_scores, plot_per_position, sample,
                                     summarize)

    check_eval_config(cfg)
    folder = weights_dir(cfg.checkpoint)
    train_cfg = OmegaConf.load(folder / "training_config.yaml")
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    lm = load_lm(folder, dtype=torch.float32).to(device).eval()
    scores, report = {}, {"checkpoint": str(folder)}

    # Perplexity, bits per byte and the loss by position on the val split.
    data_cfg = cfg.data if cfg.get("data") is not None else train_cfg.data
    if data_cfg.get("tokenizer") == "bpe":  # the checkpoint's own tokenizer, whatever data it is scored on
        data_cfg = OmegaConf.merge(data_cfg, {"tokenizer": str(folder)})
    data = build_data(data_cfg, cfg.seq_len or train_cfg.trainer.seq_len, cfg.seed)
    if data.vocab_size > lm.config.vocab_size:
        raise ValueError(f"data vocab {data.vocab_size} exceeds the model's {lm.config.vocab_size}")
    if cfg.batches != 0:
        r = evaluate_split(lm, data.val, cfg.batch_size, cfg.batches and cfg.batches * cfg.batch_size, device,
                           data.bytes_per_token, per_position=True)
        scores.update(summarize(r["loss_sum"].item(), r["count"].item(), data.bytes_per_token))
        scores["val/tokens"] = int(r["count"].item())
        scores.update({f"val/{k}": v.item() for k, v in r["aux"].items() if v.numel() == 1})
        report["per_position_loss"] = r["per_position"].tolist()
        with batch_routing_at_eval(lm) as batch_routed:
            if batch_routed:  # expert_choice / balanced: the same sequences routed as in training (not causal)
                r = evaluate_split(lm, data.val, cfg.batch_size, cfg.batches and cfg.batches * cfg.batch_size, device,
                                   data.bytes_per_token)
                scores.update(batch_routing_scores(summarize(r["loss_sum"].item(), r["count"].item(), data.bytes_per_token)))
    if data.extra_eval is not None:  # MQAR accuracy
        scores.update(data.extra_eval(lm, device))

    # Samples, then lm-evaluation-harness tasks.
    if data.tokenizer is not None and cfg.sample_tokens:
        samples = [sample(lm, data.tokenizer, cfg.sample_prompt, cfg.sample_tokens, cfg.seed + i, device,
                          temperature=cfg.sample_temperature, top_p=cfg.sample_top_p,
                          repetition_penalty=cfg.sample_repetition_penalty) for i in range(cfg.num_samples)]
        report["samples"] = [s["text"] for s in samples]
        scores["decode_tokens_per_sec"] = sum(s["decode_tokens_per_sec"] for s in samples) / len(samples)
    if cfg.tasks:
        results = lm_eval_scores(lm, folder, list(cfg.tasks), device, cfg.include_path, cfg.limit, cfg.num_fewshot,
                                 cfg.lm_eval_batch_size)
        report["lm_eval"] = results
        scores.update({f"lm_eval/{task}/{metric}": v for task, metrics in results.items() for metric, v in metrics.items()})

    # Suites: loss past the training length, recall, decode speed and memory (training/suites.py).
    out = Path(cfg.out_dir) if cfg.out_dir else folder / "eval"
    out.mkdir(parents=True, exist_ok=True)
    images = []
    if cfg.suite:
        from training.suites import run_suites

        parts, suite_scores, images = run_suites(cfg, lm, data, data_cfg, train_cfg.trainer.seq_len, device, out,
                                                 f"{folder.parent.name}/{folder.name}")
        report.update(parts)
        scores.update(suite_scores)
    report["scores"] = scores

    # Outputs: <model dir>/eval/, then the training run's W&B run.
    if "per_position_loss" in report:
        images.append(plot_per_position(report["per_position_loss"], f"{folder.parent.name}/{folder.name}",
                                        out / "per_position_loss.png"))
    with written_then_renamed(out / "eval.json") as tmp:
        tmp.write_text(json.dumps(report, indent=1))
    for key, value in scores.items():
        print(f"{key:<40} {value:.4f}" if isinstance(value, float) else f"{key:<40} {value}")
    for text in report.get("samples", []):
        print("---\n" + text)
    print(f"wrote {out / 'eval.json'}" + "".join(f", {p.name}" for p in images))
    if cfg.wandb:
        from training.tracking import log_evaluation

        run_id = log_evaluation(folder, scores, images)
        print(f"logged under eval/ in W&B run {run_id}" if run_id else "no W&B run to log into (trained with logger=none)")
    return report


if __name__ == "__main__":
    main()
