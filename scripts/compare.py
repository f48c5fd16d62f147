"""Compare training runs: a markdown + CSV table and PNG plots (docs/comparing.md, The report).

    python scripts/compare.py RUN_OR_FOLDER [...] [--wandb ENTITY/PROJECT[/GROUP]] [--out reports/x]
        [--best-over trainer.lr]
"""
import argparse
import sys
import time
from pathlib import Path

from analysis.report import compare

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", type=Path, help="run dirs, W&B offline run dirs, or folders holding them")
    p.add_argument("--wandb", help="ENTITY/PROJECT[/GROUP]: read the runs from the W&B API")
    p.add_argument("--out", type=Path, help="output folder (default reports/<date>_<time>)")
    p.add_argument("--best-over", metavar="KEY", help="a swept config key (e.g. trainer.lr): each architecture at its best value")
    args = p.parse_args(argv)
    if not args.paths and not args.wandb:
        p.error("give run folders and/or --wandb ENTITY/PROJECT[/GROUP]")
    out = args.out or ROOT / "reports" / time.strftime("%Y-%m-%d_%H-%M-%S")
    try:
        result = compare(args.paths, out, args.wandb, args.best_over)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(result["markdown"])
    for warning in result["warnings"]:
        print(f"warning: {warning}")
    print(f"\nwrote {out / 'compare.md'}, {out / 'compare.csv'} and {len(result['plots'])} plot(s)")
    return 0 if result["summaries"] else 1


if __name__ == "__main__":
    sys.exit(main())
