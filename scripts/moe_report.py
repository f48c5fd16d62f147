"""MoE load plots from a run's metrics.jsonl (the `moe/...` training metrics of model/ffn/moe.py).

    python scripts/moe_report.py <run_dir>

writes into run_dir:
- moe_load_heatmap.png: share of routed assignments per expert (layer x expert), at the last log
  and averaged over the last `last_n` logs; uniform is 1/E.
- moe_imbalance.png: max load / mean load per layer over steps (1 = balanced), and their mean.
Nothing is written (and [] returned) when the run logged no MoE metrics.
"""
import argparse
from pathlib import Path

from training.plots import plot_moe_load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a training run's folder (it has metrics.jsonl)")
    args = p.parse_args(argv)
    paths = plot_moe_load(args.run_dir)
    print("\n".join(map(str, paths)) if paths else f"no moe/ metrics in {args.run_dir / 'metrics.jsonl'}")
    return 0


if __name__ == "__main__":
    main()
