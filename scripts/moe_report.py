"""MoE load plots from a run's metrics.jsonl (the `moe/...` training metrics of model/ffn/moe.py).

    python scripts/moe_report.py <run_dir>

writes into run_dir:
- moe_load_heatmap.png: share of routed assignments per expert (layer x expert), at the last log
  and averaged over the last `last_n` logs; uniform is 1/E.
- moe_imbalance.png: max load / mean load per layer over steps (1 = balanced), and their mean.
Nothing is written (and [] returned) when the run logged no MoE metrics.
"""
import sys
from pathlib import Path

from training.plots import plot_moe_load

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {Path(__file__).name} <run_dir>")
    paths = plot_moe_load(sys.argv[1])
    print("\n".join(map(str, paths)) if paths else f"no moe/ metrics in {Path(sys.argv[1]) / 'metrics.jsonl'}")
