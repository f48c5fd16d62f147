"""The DSA workflow end to end (docs/studies/dsa.md): softmax pretrain at a short context -> DSA indexer warm-up
at a longer one -> sparse training, then a table of val loss and top-k attention recall per stage.

    python studies/dsa.py                                   # all three stages, CPU-sized
    python studies/dsa.py --softmax-run outputs/<run>       # start from an existing softmax run
    python studies/dsa.py -- logger=none model=small        # extra overrides for every stage

Each stage is a plain `train.py` run (configs/experiment/dsa_warmup.yaml, dsa_sparse.yaml) under --out, run by
analysis.runner (its console in <out>/<stage>.log); a failed stage stops the study. The summary is printed and
written to <out>/summary.md.
"""
import argparse
import json
import sys
from pathlib import Path

from analysis.runner import ROOT, log_path, run_jobs
from runs.metrics import read_metrics


def final_val(run_dir: Path) -> dict:
    return [r for r in read_metrics(run_dir) if "val/loss" in r][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--softmax-run", help="an existing softmax run dir (skips stage 0)")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "dsa_extend"))
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every stage (the stage's own come after)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def train(run: str, *overrides: str) -> Path:
        job = {"name": run, "run_dir": str(out / run), "overrides": ["trainer.sample_tokens=0", *args.overrides, *overrides]}
        if run_jobs([job])[0]["status"] != "ok":
            sys.exit(f"error: stage {run} failed; its console: {log_path(job)}")
        return out / run

    softmax = Path(args.softmax_run) if args.softmax_run else train(
        "0_softmax", "mixer=softmax", f"trainer.max_steps={args.pretrain_steps}")
    # References without training (lr 0): the softmax model at the long context, and DSA with an
    # untrained indexer (its recall is what the warm-up starts from).
    frozen = ["trainer.max_steps=1", "trainer.lr=0", "trainer.warmup_steps=0"]
    ref = train("softmax_long_context", "experiment=dsa_warmup", "mixer=softmax", "~mixer.options.stage",  # DSA's
                "trainer.trainable=null", f"init_from={softmax}", *frozen)  # option, which softmax does not take
    untrained = train("dsa_untrained_indexer", "experiment=dsa_warmup", f"init_from={softmax}", *frozen)
    warm = train("1_warmup", "experiment=dsa_warmup", f"init_from={softmax}")
    sparse = train("2_sparse", "experiment=dsa_sparse", f"init_from={warm}")

    lines = ["| stage | seq_len | val loss | val bpb | top-k recall |", "|---|---|---|---|---|"]
    for name, run in [("softmax pretrain", softmax), ("softmax at the long context (no training)", ref),
                      ("dsa, untrained indexer (no training)", untrained),
                      ("dsa warm-up (indexer only)", warm), ("dsa sparse", sparse)]:
        v = final_val(run)
        seq = json.loads((run / "run_info.json").read_text())["seq_len"]
        recall = v.get("val/dsa/topk_attention_recall")
        lines.append(f"| {name} | {seq} | {v['val/loss']:.4f} | {v.get('val/bpb', float('nan')):.4f} | "
                     + (f"{recall:.3f}" if recall is not None else "-") + " |")
    table = "\n".join(lines)
    print("\n" + table)
    (out / "summary.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
