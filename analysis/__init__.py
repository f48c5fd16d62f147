"""Comparing finished runs (docs/comparing.md): readers of run dirs and W&B runs (runs, wandb_runs), per-run
numbers (summary), architectures and the best value over a swept key with its edge flag (best), the report's
figures (plots, suites) and files (report); and what makes the runs: the one runner of train.py jobs (runner), used
by scripts/sweep.py and by every study driver (a sweep's grid: runs/sweep.py)."""
