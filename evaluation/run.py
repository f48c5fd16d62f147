"""eval.py's body: `evaluate(cfg, lm, folder)` scores a loaded checkpoint (configs/eval.yaml; docs/evaluation.md).

Loss, perplexity and bits per byte on the val split the model was trained on (or `data=...`) and the loss
by position (evaluation/scoring.py, the scorer training uses), generation samples with decode tokens/s,
lm-evaluation-harness tasks, and the suites `suite=[...]` (evaluation/suites/, one file each). Results go
to <model dir>/eval/eval.json with the PNGs (eval.py then logs them into the training run's W&B run)."""
import json
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from evaluation.suites import SUITES, suite_options_node


def register_hydra() -> None:
    """Each suite's Options dataclass as the schema of its node in eval.py's config (`length.factors=[1,2]`):
    the config `suite_options` that configs/eval.yaml lists in its defaults."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="suite_options", node=suite_options_node())


def evaluate(cfg: DictConfig, lm, folder: Path) -> tuple[dict, list[Path]]:
    """eval.json's report of the model `lm` (in eval mode, on its device) loaded from `folder` (whose
    training_config.yaml and tokenizer it reads), written to out_dir (default <folder>/eval), and the PNGs."""
    from common.files import written_then_renamed
    from data import build_data
    from evaluation.context import EvalContext
    from evaluation.harness import lm_eval_scores
    from evaluation.samples import sample
    from evaluation.scoring import score_validation
    from evaluation.per_position import plot_loss_by_position
    from model.options import parse_options

    title = f"{folder.parent.name}/{folder.name}"
    train_cfg = OmegaConf.load(folder / "training_config.yaml")
    device = next(lm.parameters()).device
    scores, report, images = {}, {"checkpoint": str(folder)}, []
    out = Path(cfg.out_dir) if cfg.out_dir else folder / "eval"
    out.mkdir(parents=True, exist_ok=True)

    # Perplexity, bits per byte and the loss by position on the val split.
    data_cfg = cfg.data if cfg.get("data") is not None else train_cfg.data
    if data_cfg.get("tokenizer") == "bpe":  # the checkpoint's own tokenizer, whatever data it is scored on
        data_cfg = OmegaConf.merge(data_cfg, {"tokenizer": str(folder)})
    train_seq_len = train_cfg.trainer.seq_len
    data = build_data(data_cfg, cfg.seq_len or train_seq_len, cfg.seed)
    if data.vocab_size > lm.config.vocab_size:
        raise ValueError(f"data vocab {data.vocab_size} exceeds the model's {lm.config.vocab_size}")
    if cfg.batches != 0:
        val = score_validation(lm, data, cfg.batch_size, cfg.batches and cfg.batches * cfg.batch_size, device,
                               per_position=True)
        report["per_position_loss"] = val.pop("per_position")
        scores.update({k: v.item() if torch.is_tensor(v) else v for k, v in val.items()
                       if not torch.is_tensor(v) or v.numel() == 1})
        images.append(plot_loss_by_position({"val": report["per_position_loss"]}, None, title, out / "per_position_loss.png"))
    elif data.extra_eval is not None:  # MQAR accuracy
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

    # The suites, each with its options (evaluation/suites/).
    ctx = EvalContext(lm, data, data_cfg, train_seq_len, device, cfg.seed, cfg.batch_size, title)
    for name in cfg.suite:
        suite = SUITES.get(name)()
        opts = parse_options(f"{name} suite", suite.Options, OmegaConf.to_container(cfg[name], resolve=True))
        report[name] = suite.run(ctx, opts)
        scores.update(suite.scores(report[name]))
        images += suite.plot(report[name], title, out)
    report["scores"] = scores

    # Outputs: <model dir>/eval/, then the training run's W&B run.
    with written_then_renamed(out / "eval.json") as tmp:
        tmp.write_text(json.dumps(report, indent=1))
    for key, value in scores.items():
        print(f"{key:<40} {value:.4f}" if isinstance(value, float) else f"{key:<40} {value}")
    for text in report.get("samples", []):
        print("---\n" + text)
    print(f"wrote {out / 'eval.json'}" + "".join(f", {p.name}" for p in images))
    return report, images
