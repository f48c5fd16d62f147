"""Evaluate a checkpoint: python eval.py checkpoint=<run dir | final/ | checkpoints/step_N> [key=value ...]

Val loss, perplexity and bits per byte, the loss by position, samples, lm-evaluation-harness tasks
(`tasks=[lambada_openai]`) and the suites (`suite=[length,recall,decode]`), into <model dir>/eval/eval.json
and the training run's W&B run: evaluation/run.py; options: configs/eval.yaml; docs/evaluation.md.
"""
import sys

import hydra
from omegaconf import DictConfig

from evaluation.run import register_hydra

register_hydra()


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(cfg: DictConfig) -> None:
    from evaluation.run import evaluate

    try:
        evaluate(cfg)
    except (ValueError, FileNotFoundError) as e:  # configuration and input errors: one line, no traceback
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
