"""A run's metrics.jsonl, one JSON row per log ({"step": N, ...}): its writer (the main process; also the Accelerate
trackers: W&B, offline unless logged in, runs/tracking.py sets the run up) and its readers. Vector metrics
(per-expert loads) go to jsonl as lists and to W&B as one scalar per element, named by what the element is
(moe/layer0/load -> moe/layer0/expert3/load), so that each expert is one line."""
import json
import re
import statistics
from pathlib import Path

import torch

from common.files import written_then_renamed


def to_python(value):
    if torch.is_tensor(value):
        value = value.detach().float().cpu()
        return value.item() if value.numel() == 1 else value.tolist()
    return value


class MetricsWriter:
    def __init__(self, accelerator, run_dir: Path, use_tracker: bool, step: int = 0):
        """A run at `step` (resumed from its checkpoint there, or starting at 0) keeps the finished rows of the steps
        up to it and drops any later ones: a run killed past its last checkpoint (SIGKILL) logged steps that the
        resumed run logs again. `rows`: the file's rows as read_metrics would read them (the main process's; none on
        the others), kept and logged."""
        self.accelerator = accelerator
        self.path = Path(run_dir) / "metrics.jsonl"
        self.use_tracker = use_tracker
        self.rows = keep_rows_until(self.path, step) if accelerator.is_main_process else []

    def log(self, metrics: dict, step: int) -> None:
        if not self.accelerator.is_main_process:
            return
        row = {"step": step, **{k: to_python(v) for k, v in metrics.items()}}
        line = json.dumps(row)
        with self.path.open("a") as f:
            f.write(line + "\n")
        self.rows.append(json.loads(line))
        if self.use_tracker:
            tracked = {}
            for k, v in row.items():
                if k != "step":
                    tracked.update(per_element(k, v) if isinstance(v, list) else {k: v})
            self.accelerator.log(tracked, step=step)


ELEMENT = re.compile(r"^(.*)/(group_)?load$")  # moe/layer<i>/load (per expert), moe/layer<i>/group_load (per group)


def per_element(key: str, values: list) -> dict:
    """A vector metric as scalars: moe/layer0/load -> moe/layer0/expert<j>/load, .../group_load ->
    .../group<j>/load; any other vector -> <key>/<j>."""
    if m := ELEMENT.match(key):
        kind = "group" if m.group(2) else "expert"
        return {f"{m.group(1)}/{kind}{j}/load": v for j, v in enumerate(values)}
    return {f"{key}/{j}": v for j, v in enumerate(values)}


def finished_rows(text: str) -> str:
    """The rows up to the last newline: a row is finished once its newline is written. A reader of a
    live run can see the row being written half-way (one append is not atomic for a reader), and a run
    killed mid-append leaves one half-written."""
    return text[: text.rfind("\n") + 1]


def keep_rows_until(path: Path, step: int) -> list[dict]:
    """The finished rows of steps up to `step` (none at step 0: a run starting there logs afresh), rewritten through
    a temp file where that drops any: a resumed run appends after them, not onto a half-written row nor after rows
    of steps it runs again. Returns the rows kept."""
    if not path.exists():
        return []
    lines = finished_rows(text := path.read_text()).splitlines(keepends=True)
    kept = [line for line in lines if step and line.strip() and json.loads(line)["step"] <= step]
    if "".join(kept) != text:
        with written_then_renamed(path) as tmp:
            tmp.write_text("".join(kept))
    return [json.loads(line) for line in kept]


def read_metrics(run_dir: Path) -> list[dict]:
    """The finished rows (a live run may be writing its next one)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in finished_rows(path.read_text()).splitlines() if line.strip()] if path.exists() else []


def logged(rows: list[dict], key: str) -> list[float]:
    """The numeric values of `key` over the rows that logged it, in order."""
    return [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def median_after_first(rows: list[dict], key: str) -> float | None:
    """The median of `key` over the logging windows after the first (which includes warm-up and first-call
    costs), or over the first where it is the only one; None if never logged."""
    values = logged(rows, key)
    return statistics.median(values[1:] or values) if values else None
