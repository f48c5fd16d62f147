"""Training components used by train.py (and the scripts): optimizer and schedule, metrics,
checkpoints, hardware peaks. Each file is one concern."""
