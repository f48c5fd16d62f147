"""Evaluate a checkpoint: loss, perplexity and bits per byte on the val split (or a given dataset),
a per-position loss curve (PNG), generation samples and decode tokens/s; all written to eval.json.

    python scripts/evaluate.py checkpoint=outputs/<run>/final
    python scripts/evaluate.py checkpoint=outputs/<run> data=local data.path=my_texts/ batches=50
    python scripts/evaluate.py checkpoint=outputs/<run>/checkpoints/step_0000100   # a mid-run checkpoint
"""
import json
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf


@hydra.main(version_base="1.3", config_path="../configs", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    try:
        evaluate(cfg)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")


def evaluate(cfg: DictConfig) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from common.files import written_then_renamed
    from data import build_data
    from training.checkpoint import load_lm, weights_dir
    from training.evaluation import evaluate_split, sample, summarize

    folder = weights_dir(cfg.checkpoint)
    train_cfg = OmegaConf.load(folder / "training_config.yaml")
    data_cfg = cfg.data if cfg.get("data") is not None else train_cfg.data
    seq_len = cfg.seq_len or train_cfg.trainer.seq_len
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lm = load_lm(folder).to(device).eval()
    if data_cfg.get("tokenizer") == "bpe":
        # Reuse the checkpoint's own tokenizer, whatever data it is evaluated on.
        data_cfg = OmegaConf.merge(data_cfg, {"tokenizer": str(folder)})
    data = build_data(data_cfg, seq_len, cfg.seed)
    if data.vocab_size > lm.config.vocab_size:
        raise ValueError(f"data vocab {data.vocab_size} exceeds the model's {lm.config.vocab_size}")

    r = evaluate_split(lm, data.val, cfg.batch_size, cfg.batches and cfg.batches * cfg.batch_size, device, data.bytes_per_token, per_position=True)
    report = summarize(r["loss_sum"].item(), r["count"].item(), data.bytes_per_token)
    report.update({f"val/{k}": v.item() if v.numel() == 1 else v.tolist() for k, v in r["aux"].items()})
    report["val_tokens"] = int(r["count"].item())
    report["per_position_loss"] = r["per_position"].tolist()
    if data.extra_eval is not None:
        report.update(data.extra_eval(lm, device))
    if data.tokenizer is not None and cfg.sample_tokens:
        samples = [sample(lm, data.tokenizer, cfg.prompt, cfg.sample_tokens, cfg.seed + i, device,
                          temperature=cfg.sample_temperature, top_p=cfg.sample_top_p,
                          repetition_penalty=cfg.sample_repetition_penalty) for i in range(cfg.num_samples)]
        report["samples"] = [s["text"] for s in samples]
        report["decode_tokens_per_sec"] = sum(s["decode_tokens_per_sec"] for s in samples) / len(samples)

    out = Path(cfg.out_dir) if cfg.out_dir else folder / "eval"
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    curve = r["per_position"]
    ax.plot(range(2, len(curve) + 2), curve.numpy())  # position t+1 is predicted from t+1 tokens of context
    ax.set_xscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{folder.parent.name}/{folder.name}: val loss by position")
    fig.tight_layout()
    fig.savefig(out / "per_position_loss.png", dpi=120)
    plt.close(fig)
    with written_then_renamed(out / "eval.json") as tmp:
        tmp.write_text(json.dumps(report, indent=1))
    print(f"val loss {report['val/loss']:.4f} | ppl {report['val/ppl']:.2f}"
          + (f" | bpb {report['val/bpb']:.4f}" if "val/bpb" in report else "")
          + (f" | decode {report['decode_tokens_per_sec']:.0f} tok/s" if "decode_tokens_per_sec" in report else ""))
    for text in report.get("samples", []):
        print("---\n" + text)
    print(f"wrote {out / 'eval.json'} and {out / 'per_position_loss.png'}")
    return report


if __name__ == "__main__":
    main()
