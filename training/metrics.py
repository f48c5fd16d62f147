"""The logging window of the training loop: its sums since the last row of metrics.jsonl (the file: runs/metrics.py),
and the device peak its MFU is measured against (training/perf.py)."""
from evaluation.scoring import perplexity


class Meter:
    """The logging window: sums over the optimizer steps since the last log row; `peak` (training/perf.py Peak) of
    one device, MFU = achieved per device / peak.flops."""

    def __init__(self, peak):
        self.peak = peak
        self.reset()

    def reset(self) -> None:
        self.loss, self.steps, self.seconds, self.aux = 0.0, 0, 0.0, {}

    def add(self, loss: float, seconds: float, aux: dict) -> None:
        self.loss += loss
        self.steps += 1
        self.seconds += seconds
        for k, v in aux.items():
            self.aux[k] = self.aux.get(k, 0) + v

    def row(self, tokens_per_step: int, flops_per_token: float) -> dict:
        """Means over the window (and throughput over its wall time, all processes together); then
        the window restarts."""
        n = self.steps
        tok_s = tokens_per_step * n / self.seconds
        out = {"train/loss": self.loss / n, "train/ppl": perplexity(self.loss / n), "perf/tokens_per_sec": tok_s,
               "perf/step_time": self.seconds / n, "perf/tflops": flops_per_token * tok_s / 1e12,
               **{k: v / n for k, v in self.aux.items()}}
        self.reset()
        return out
