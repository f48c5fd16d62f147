"""The GPU self-check (docs/gpu.md; scripts/gpu_check.py runs it): stages of checks, each case guarded and each
check under its own deadline."""
