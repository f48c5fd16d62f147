"""The study drivers, each named after its page in docs/studies/ (python studies/<name>.py --help)."""
