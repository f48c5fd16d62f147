"""Evaluate a checkpoint: python eval.py checkpoint=<run dir | final/ | checkpoints/step_N> [key=value ...]

The Hydra entry: compose configs/eval.yaml with the command line, check it, load the model, hand both to
evaluation/run.py (val loss, perplexity and bits per byte, the loss by position, samples, lm-evaluation-
harness `tasks=[...]`, the suites `suite=[length,recall,decode]`, into <model dir>/eval/eval.json), then log
the scores into the training run's W&B run, if it had one (docs/evaluation.md).
"""
import sys

import hydra
from omegaconf import DictConfig

from evaluation.run import register_hydra
from common.validation import error_message

register_hydra()


def evaluate_checkpoint(cfg: DictConfig) -> dict:
    """eval.py's run of a composed config: the report eval.json holds."""
    import torch

    from evaluation.run import evaluate
    from runs.checkpoint import load_lm, weights_dir
    from evaluation.validation import check_eval_config

    check_eval_config(cfg)
    folder = weights_dir(cfg.checkpoint)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    report, images = evaluate(cfg, load_lm(folder, dtype=torch.float32).to(device).eval(), folder)
    if cfg.wandb:
        from runs.tracking import log_evaluation

        run_id = log_evaluation(folder, report["scores"], images)
        print(f"logged under eval/ in W&B run {run_id}" if run_id else "no W&B run to log into (trained with logger=none)")
    return report


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(cfg: DictConfig) -> None:
    try:
        evaluate_checkpoint(cfg)
    except (ValueError, FileNotFoundError) as e:  # configuration and input errors: a line each, no traceback
        sys.exit(error_message(e))


if __name__ == "__main__":
    main()
