"""Benchmarks (speed is measured here, never asserted in tests). Figures are meant to be read as
ratios against a peer measured in the same run, since machines are noisy.

    python scripts/bench.py                 # every suite
    python scripts/bench.py gdn mamba2      # chosen suites; `--help` lists them (cp, data, decode, delta, docmask,
                                            # dsa, ep, gdn, mamba2, model, moe, recipe, scaling)
    python scripts/bench.py moe --quick     # small shapes, a smoke run

Each suite is a module in scripts/benchmarks/ with `run(quick: bool) -> str` returning a markdown
report; the reports are printed and written to outputs/bench/<suite>.md.
"""
import argparse
import importlib
import pkgutil
from pathlib import Path

import scripts.benchmarks as benchmarks

ROOT = Path(__file__).resolve().parents[1]

SUITES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name != "common")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suites", nargs="*", help=f"any of: {', '.join(SUITES)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "bench"))
    args = parser.parse_args()
    for name in args.suites:
        if name not in SUITES:
            parser.error(f"unknown suite {name!r}; valid: {', '.join(SUITES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.suites or SUITES:
        report = importlib.import_module(f"scripts.benchmarks.{name}").run(quick=args.quick)
        print(f"\n## {name}\n\n{report}")
        (out / f"{name}.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
