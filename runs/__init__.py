"""What a run is and leaves on disk, shared by training/, evaluation/ and analysis/ (which import none of each other):
composing its config (config.py), the sweep's jobs (sweep.py), its metrics.jsonl (metrics.py), reading its
weights back (checkpoint.py), its training FLOPs per token (flops.py), its W&B run (tracking.py) and its own plots
(plots.py)."""
