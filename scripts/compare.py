"""Compare training runs: a markdown + CSV table and PNG plots.

    python scripts/compare.py RUN_OR_FOLDER [...] [--wandb ENTITY/PROJECT[/GROUP]] [--out reports/x]
        [--best-over trainer.lr]

Inputs (any mix, from any number of sweeps):
- a local run dir (metrics.jsonl + config.yaml, run_info.json, final/), or a folder searched for them
  (a sweep folder, outputs/, multirun/);
- a W&B offline run dir (wandb/offline-run-*/run-*.wandb), or a folder holding some; run dirs that
  have metrics.jsonl are read from it, not from their own wandb/ subfolder;
- --wandb ENTITY/PROJECT[/GROUP]: the finished runs of a W&B project (one group), via the W&B API.
A run without val metrics, or a local run without final/, or a W&B run that did not finish, is
skipped with a note.

Writes to --out (default reports/<date>_<time>):
- compare.md, compare.csv: one row per run. compare.md opens with the budget the runs compare at: "equal FLOPs
  (trainer.flops_budget=...)", "equal tokens (trainer.tokens_budget=...)", "equal steps (trainer.max_steps=N,
  tokens=...)" (steps, batch and seq_len shared), else "mixed budgets: ..." with each budget's run count;
  train_flops is the final tokens x run_info.json's train_flops_per_token (rebuilt from the config if absent);
- val_loss_tokens.png, val_loss_time.png: val loss against tokens seen and wall-clock seconds;
- val_bpb_flops.png, val_bpb_time.png (and under --best-over best_<KEY>/all_val_bpb_flops.png, all_val_bpb_time.png:
  one line per architecture at its best value, its seeds averaged): val bpb (val loss unless every run has bpb) against training FLOPs
  (tokens seen x train_flops_per_token, log x) and wall-clock seconds;
- throughput.png: training tokens/s per run (MFU in the label);
- moe_load.png: per-expert share of routed tokens (layer x expert) at the last log, one panel per
  MoE run (W&B runs log each expert's load as its own scalar, moe/layer<i>/expert<j>/load);
- mqar_state.png, mqar_width.png (runs with val/mqar_acc): MQAR accuracy against recurrent state
  size (numbers held by the decode cache per sequence after seq_len tokens, summed over layers:
  softmax K/V = 2 L T H_kv d_head, gdn/linear H K V (+ normaliser/conv buffers), mamba2 H P N
  (+ conv)) and against d_model, one line per mixer, as in zoology;
- from eval.py's suites in <run>/final/eval/eval.json (a run without a suite's block is left out of its plots):
  length.png (loss by position at the longest length evaluated, averaged in log-spaced bins, log x, a line at the
  training length) and the
  table "Loss by length" in compare.md (loss per band: 1x, 2x, ... the training length); recall_state.png (recall
  accuracy, passkey or an MQAR run's at that seq_len, against decode-cache bytes at the largest context every run's
  recall and decode suites share, coloured by mixer, as zoology); recall_throughput.png (recall/acc or
  recall/mqar_acc against decode tokens/s at the largest context every run decoded, as Based); decode.png (decode
  tokens/s and cache bytes against the context).
MoE runs show their router in the ffn column (moe:expert_choice; top-k is plain moe) and the last
logged moe/dead_experts, moe/unrouted_frac, moe/token_choice_overlap and val/batch_routing/bpb
(docs/moe.md). Columns also give the W&B group and eval.py's scores (eval/..., from <run>/final/eval/eval.json and
checkpoints/step_N/eval/eval.json, or the W&B run's summary). Parameter counts come from run_info.json or the W&B config; else the model is rebuilt from the
config (on the meta device) and counted.

--best-over KEY (a dotted config key, e.g. trainer.lr): runs whose configs differ only in KEY and seed
are one architecture; runs at different budgets are different architectures (a budget's derived
trainer.max_steps aside), each budget with its own tables, named in the heading. Per architecture and
KEY value the score (MQAR accuracy if every run of the architecture has one, else val loss) is averaged
over the seeds that ran at every value (all seeds where none did), and the best value is picked on these
means; the table "best KEY per architecture" gives the best value's mean and min-max over all its seeds,
every value's matched mean and an edge flag: "low edge" / "high edge" when the best is the smallest / largest value swept
(numeric KEY), "single value" when only one was. Each flagged architecture gets a bold warning under the
table and a console line with the scripts/sweep.py command that sweeps one step beyond (its best run's
overrides from .hydra/overrides.yaml, else the config entries that tell it from the others; KEY continuing
the grid's ratio; its seeds). best_<KEY>/<arch>.png plots the score against KEY (every seed a dot, the
mean a line; log x), as muP / zoology do; best_<KEY>/all_val_loss.png (all_mqar_acc.png) puts every
architecture on one axis when KEY is numeric (val loss against ffn.options.num_experts per router, say). A
second table gives, at each architecture's best KEY, the mean over seeds of val_bpb, tokens/s, train_flops
and the MoE routing columns. Architectures with the same blocks and width are named by the options that
differ. compare.csv gains each run's architecture and edge; best_over.json holds per architecture its
budget, score, best value, means, edge, the values beyond it and the command. With --wandb, the runs at a
flagged architecture's best value get the W&B tag best-on-grid-edge (removed from the others; a failure is
a note). The MQAR and suite plots then show each architecture at its best KEY (the suite blocks averaged
over seeds).
"""
import argparse
import csv
import json
import re
import shlex
import statistics
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from training.plots import LOAD  # moe/layer<i>/load
from training.metrics import read_metrics
from training.suites import log_binned
from training.tracking import schedule_tag

ROOT = Path(__file__).resolve().parents[1]

COLUMNS = ["run", "group", "mixer", "ffn", "d_model", "layers", "params_total", "params_active", "tokens", "train_flops", "budget", "val_loss",
           "val_ppl", "val_bpb", "val_bpb_batch_routing", "tokens_per_sec", "mfu", "peak_mem_gb", "wall_s",
           "moe_imbalance", "moe_dead_experts", "moe_unrouted_frac", "moe_token_choice_overlap", "mqar_acc",
           "state_size", "source"]


@dataclass
class Run:
    name: str
    source: str  # where it was read from
    config: dict  # the resolved train.py config
    rows: list[dict]  # metrics rows, each with "step"
    params: dict | None = None
    complete: bool = True
    note: str = ""
    summary: dict = field(default_factory=dict)  # eval.py's scores under eval/ (eval/step_N/ for a checkpoint)
    group: str = ""
    info: dict = field(default_factory=dict)  # run_info.json
    report: dict = field(default_factory=dict)  # eval.py's final/eval/eval.json (its suites' blocks)
    overrides: list[str] | None = None  # train.py's command-line overrides (Hydra's .hydra/overrides.yaml)
    handle: object = None  # the wandb.Api run it was read from

    def __post_init__(self):
        from training.config import with_current_names

        self.config = with_current_names(self.config)  # runs saved when mixer was called attention


# ---- readers ---------------------------------------------------------------------------------------
def read_local(run_dir: Path) -> Run:
    from omegaconf import OmegaConf

    cfg_file = next((p for p in (run_dir / "config.yaml", run_dir / "final" / "training_config.yaml") if p.exists()), None)
    config = OmegaConf.to_container(OmegaConf.load(cfg_file)) if cfg_file else {}
    info = json.loads((run_dir / "run_info.json").read_text()) if (run_dir / "run_info.json").exists() else {}
    overrides = run_dir / ".hydra" / "overrides.yaml"
    run = Run(run_dir.name, str(run_dir), config, read_metrics(run_dir), info.get("params"), group=info.get("group") or "",
              info=info, overrides=OmegaConf.to_container(OmegaConf.load(overrides)) if overrides.exists() else None)
    if not (run_dir / "final").exists():
        run.complete, run.note = False, "no final/ (unfinished or failed)"
    for report in [run_dir / "final" / "eval" / "eval.json", *sorted(run_dir.glob("checkpoints/step_*/eval/eval.json"))]:
        if report.exists():
            data = json.loads(report.read_text())
            prefix = "eval/" if report.parts[-3] == "final" else f"eval/{report.parts[-3]}/"
            run.summary.update({prefix + k: v for k, v in data.get("scores", {}).items()})
            if prefix == "eval/":
                run.report = data
    return run


WANDB_BLOCK = 32768  # the .wandb file is a LevelDB-format log of wandb Record protobufs


def wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    pos, buf = 7, b""  # 7-byte file header, then records: crc32 (4) length (2) type (1) payload
    while pos + 7 <= len(data):
        if WANDB_BLOCK - pos % WANDB_BLOCK < 7:  # a block tail too short for a header is padding
            pos += WANDB_BLOCK - pos % WANDB_BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def unflatten(items) -> dict:
    out = {}
    for item in items:
        keys = list(item.nested_key) or [item.key]
        d = out
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = json.loads(item.value_json)
    return out


EXPERT_LOAD = re.compile(r"^(moe/layer\d+)/expert(\d+)/load$")


def history_row(values: dict) -> dict:
    """A W&B history row -> a metrics row: 'step' from _step, wall-clock from _runtime, per-expert
    scalars back into moe/layer<i>/load vectors, media dropped."""
    row = {k: v for k, v in values.items() if not k.startswith("_") and not isinstance(v, (dict, list))}
    loads = {}
    for k in [k for k in row if EXPERT_LOAD.match(k)]:
        m = EXPERT_LOAD.match(k)
        loads.setdefault(m.group(1), {})[int(m.group(2))] = row.pop(k)
    for layer, by_expert in loads.items():
        row[f"{layer}/load"] = [by_expert.get(e, 0.0) for e in range(max(by_expert) + 1)]
    row["step"] = values.get("_step", 0)
    if "_runtime" in values and "time/elapsed" not in row:
        row["time/elapsed"] = values["_runtime"]
    return row


def read_wandb_offline(folders: list[Path]) -> Run:
    """One W&B run from its offline folders (training, each resume, each eval.py), oldest first: later
    folders add history rows (a step logged twice keeps its later value), config and summary."""
    config, rows, summary, exit_code, name, group = {}, {}, {}, None, folders[0].name, ""
    for folder in folders:
        for record in wandb_records(next(folder.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                config.update(unflatten(record.run.config.update))
                name, group = record.run.display_name or record.run.run_id, record.run.run_group or group
            elif kind == "config":
                config.update(unflatten(record.config.update))
            elif kind == "history":
                flat = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                rows[record.history.step.num] = history_row({**flat, "_step": record.history.step.num})
            elif kind == "summary":
                summary.update({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.summary.update})
            elif kind == "exit" and config.get("trainer"):  # an eval.py folder's exit is not the training's
                exit_code = record.exit.exit_code
    config.pop("_wandb", None)
    run = Run(name, str(folders[-1]), config, [rows[k] for k in sorted(rows)], config.pop("params", None),
              summary={k: v for k, v in summary.items() if k.startswith("eval/")}, group=group)
    if exit_code != 0:
        run.complete, run.note = False, "W&B run did not finish" if exit_code is None else f"W&B exit code {exit_code}"
    return run


def read_wandb_api(path: str) -> list[Run]:
    import wandb

    parts = path.strip("/").split("/")
    if len(parts) not in (2, 3):
        raise ValueError(f"--wandb {path!r}: expected ENTITY/PROJECT or ENTITY/PROJECT/GROUP")
    filters = {"group": parts[2]} if len(parts) == 3 else {}
    runs = []
    for r in wandb.Api().runs("/".join(parts[:2]), filters=filters):
        config = {k: v for k, v in r.config.items() if not k.startswith("_")}
        run = Run(r.name, r.url, config, [history_row(h) for h in r.scan_history()], config.pop("params", None),
                  summary={k: v for k, v in r.summary.items() if k.startswith("eval/")}, group=r.group or "", handle=r)
        if r.state != "finished":
            run.complete, run.note = False, f"W&B state {r.state}"
        runs.append(run)
    return runs


def natural_key(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def discover(paths: list[Path]) -> tuple[list[Run], list[str]]:
    """Runs under the given paths (a run dir's own wandb/ folder is not read twice; the offline
    folders of one W&B run id are read as one run)."""
    runs, notes, seen, offline = [], [], set(), {}

    def visit(p: Path):
        if p.resolve() in seen:
            return
        seen.add(p.resolve())
        if (p / "metrics.jsonl").exists():
            runs.append(read_local(p))
        elif list(p.glob("run-*.wandb")):
            run_id = next(p.glob("run-*.wandb")).stem.removeprefix("run-")
            if run_id not in offline:
                offline[run_id] = []
                runs.append(run_id)  # a placeholder, read once all its folders are found
            offline[run_id].append(p)
        elif p.is_dir():
            children = [c for c in p.iterdir() if c.is_dir() and not c.name.startswith(".")]
            for child in sorted(children, key=natural_key):  # sweep jobs in job order: 2_x before 10_x
                visit(child)

    for p in paths:
        if not p.exists():
            notes.append(f"{p}: does not exist")
            continue
        before = len(runs)
        visit(p)
        if len(runs) == before:
            notes.append(f"{p}: no runs found (no metrics.jsonl or run-*.wandb)")
    runs = [read_wandb_offline(sorted(offline[r], key=lambda f: f.name)) if isinstance(r, str) else r for r in runs]
    names = [r.name for r in runs]
    for r in runs:  # jobs of different sweeps share names (0_0): such a local run is named <sweep folder>/<job>
        if names.count(r.name) > 1 and Path(r.source).is_dir():
            r.name = f"{Path(r.source).parent.name}/{r.name}"
    return runs, notes


# ---- per-run numbers -------------------------------------------------------------------------------
def flat(config: dict, prefix: str = "") -> dict:
    """{dotted key: leaf value} of a nested config."""
    out = {}
    for k, v in config.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def cfg_get(config: dict, dotted: str, default=None):
    d = config
    for k in dotted.split("."):
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def build_model(config: dict, meta: bool):
    """DecoderLM of a resolved train.py config (vocab from data.vocab_size)."""
    import torch
    from omegaconf import OmegaConf

    from model import DecoderLM
    from training.config import lm_config

    cfg = OmegaConf.create(config)
    with torch.device("meta") if meta else torch.device("cpu"):
        return DecoderLM(lm_config(cfg, cfg.data.vocab_size, None))


STATE_SIZES: dict[str, int] = {}  # architecture (JSON) -> state_size


def state_size(config: dict) -> int:
    """Numbers in the decode cache of one sequence after trainer.seq_len tokens, summed over layers
    (computed once per architecture: runs of an lr or seed sweep share it)."""
    shape = json.dumps({**{k: config.get(k) for k in ("model", "mixer", "ffn")}, "seq_len": config["trainer"]["seq_len"],
                        "vocab": cfg_get(config, "data.vocab_size")}, sort_keys=True, default=str)
    if shape not in STATE_SIZES:
        STATE_SIZES[shape] = cache_numbers(config)
    return STATE_SIZES[shape]


def cache_numbers(config: dict) -> int:
    return decode_state_numbers(build_model(config, meta=False), config["trainer"]["seq_len"])


def decode_state_numbers(model, seq_len: int) -> int:
    """Numbers in the model's decode cache of one sequence after seq_len tokens, summed over layers."""
    import torch

    from model.lm import DecodeCache

    cache = DecodeCache(model.config.num_hidden_layers)
    with torch.no_grad():
        model.eval()(input_ids=torch.zeros(1, seq_len, dtype=torch.long), past_key_values=cache, use_cache=True)
    return sum(v.numel() for layer in cache.layers for v in layer.values() if torch.is_tensor(v))


def last(rows: list[dict], key: str):
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return values[-1] if values else None


def median_after_first(rows: list[dict], key: str):
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    values = values[1:] or values  # the first window includes warm-up
    return statistics.median(values) if values else None


def wall_clock(rows: list[dict]) -> list[tuple[int, float]]:
    """(step, seconds since start) per row: time/elapsed when logged, else the cumulated perf/step_time."""
    if any("time/elapsed" in r for r in rows):
        return [(r["step"], r["time/elapsed"]) for r in rows if "time/elapsed" in r]
    out, total, prev = [], 0.0, 0
    for r in rows:
        if "perf/step_time" in r:
            total += r["perf/step_time"] * (r["step"] - prev)
            prev = r["step"]
            out.append((r["step"], total))
    return out


def budget(config: dict) -> tuple[str, str]:
    """(axis, setting) of the budget a run trained for: its trainer.flops_budget, else its trainer.tokens_budget
    (either set its max_steps), else its steps and batch."""
    t = config.get("trainer") or {}
    for key, axis in (("flops_budget", "FLOPs"), ("tokens_budget", "tokens")):
        if t.get(key) is not None:
            return axis, f"trainer.{key}={t[key]:g}"
    steps, batch, seq_len = t.get("max_steps"), t.get("batch_size"), t.get("seq_len")
    tokens = steps * batch * seq_len if steps and batch and seq_len else None
    return "steps", f"trainer.max_steps={steps}, tokens={fmt(tokens, 'tokens')}"


def budget_line(configs: list[dict]) -> str:
    """The budget the runs compare at: 'equal FLOPs (trainer.flops_budget=...)', 'equal tokens (...)', 'equal
    steps (...)', or 'mixed budgets: ...' with each budget's run count."""
    budgets = [budget(c) for c in configs]
    counts = {b: budgets.count(b) for b in budgets}
    if len(counts) == 1:
        return f"equal {budgets[0][0]} ({budgets[0][1]})"
    return "mixed budgets: " + "; ".join(f"{setting} ({n} run{'s' * (n > 1)})" for (_, setting), n in counts.items())


def summarize_run(run: Run) -> dict:
    c, rows = run.config, run.rows
    if c and run.params is None:  # rebuilt and counted as training/run.py counts
        run.params = build_model(c, meta=True).parameter_counts()
    if c and run.info.get("train_flops_per_token") is None and {"data", "trainer"} <= c.keys():  # a run from before
        run.info["train_flops_per_token"] = 3 * build_model(c, meta=True).flops_per_token(c["trainer"]["seq_len"])
    flops_per_token, tokens = run.info.get("train_flops_per_token"), last(rows, "tokens_seen")
    mixer = cfg_get(c, "model.mixer") or cfg_get(c, "mixer.name") or cfg_get(c, "arch.mixer")
    ffn = cfg_get(c, "model.ffn") or cfg_get(c, "ffn.name") or cfg_get(c, "arch.ffn")
    router = cfg_get(c, "ffn.options.router")
    if router not in (None, "topk") and not isinstance(ffn, list):
        ffn = f"{ffn}:{router}"  # moe:expert_choice (top-k, the default router, is plain moe)
    clock = wall_clock(rows)
    s = {
        "run": run.name, "mixer": schedule_tag(mixer) if isinstance(mixer, list) else mixer,
        "ffn": schedule_tag(ffn) if isinstance(ffn, list) else ffn, "d_model": cfg_get(c, "model.hidden_size"),
        "layers": cfg_get(c, "model.num_hidden_layers"),
        "params_total": (run.params or {}).get("total"), "params_active": (run.params or {}).get("active"),
        "tokens": tokens, "train_flops": tokens * flops_per_token if tokens is not None and flops_per_token else None,
        "train_flops_per_token": flops_per_token, "val_loss": last(rows, "val/loss"), "val_ppl": last(rows, "val/ppl"),
        "val_bpb": last(rows, "val/bpb"), "tokens_per_sec": median_after_first(rows, "perf/tokens_per_sec"),
        "mfu": median_after_first(rows, "perf/mfu"),
        "peak_mem_gb": max((r["perf/peak_mem_gb"] for r in rows if "perf/peak_mem_gb" in r), default=None),
        "wall_s": clock[-1][1] if clock else None, "moe_imbalance": last(rows, "moe/imbalance"),
        "val_bpb_batch_routing": last(rows, "val/batch_routing/bpb"), "moe_dead_experts": last(rows, "moe/dead_experts"),
        "moe_unrouted_frac": last(rows, "moe/unrouted_frac"), "moe_token_choice_overlap": last(rows, "moe/token_choice_overlap"),
        "mqar_acc": last(rows, "val/mqar_acc"), "state_size": None, "group": run.group or None, "source": run.source,
        "budget": budget(c)[1], **{k: v for k, v in run.summary.items() if k.startswith("eval/") and isinstance(v, (int, float))},
    }
    if s["mqar_acc"] is not None and c:
        s["state_size"] = state_size(c)
        final = next(r for r in reversed(rows) if "val/mqar_acc" in r)
        s.update({k.removeprefix("val/"): v for k, v in final.items() if k.startswith("val/mqar_acc/")})
    return s


# ---- outputs ---------------------------------------------------------------------------------------
def fmt(value, key: str) -> str:
    if value is None:
        return "-"
    if key.startswith("params") or key in ("tokens", "state_size"):
        return f"{value / 1e6:.2f}M" if value >= 1e6 else f"{value / 1e3:.1f}k" if value >= 1e4 else str(int(value))
    if key == "mfu":
        return f"{100 * value:.1f}%"
    if key == "train_flops":
        return f"{value:.3g}"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def markdown_table(summaries: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(s.get(c), c) for c in columns) + " |" for s in summaries]
    return "\n".join(lines)


CURVE_AXES = {"tokens": "tokens seen", "time": "wall-clock (s)",
              "flops": "training FLOPs (tokens seen x train FLOPs per token)"}


def curve(run: Run, summary: dict, x: str, metric: str) -> list[tuple[float, float]]:
    """(x, metric) at each of the run's logs of metric; x (CURVE_AXES): tokens seen, wall-clock seconds, or training
    FLOPs = tokens seen x run_info.json's train_flops_per_token (a row's own flops_seen where it has one; the
    zero-FLOPs log before training is left out of that log axis)."""
    clock, per_token = dict(wall_clock(run.rows)), summary["train_flops_per_token"]

    def flops(row):
        if "flops_seen" in row:
            return row["flops_seen"] or None
        return row["tokens_seen"] * per_token if row.get("tokens_seen") and per_token else None

    at = {"tokens": lambda r: r.get("tokens_seen"), "time": lambda r: clock.get(r["step"]), "flops": flops}[x]
    return [(at(r), r[metric]) for r in run.rows if metric in r and at(r) is not None]


def style_curve_axes(ax, x: str, metric: str) -> None:
    """A metric-against-budget plot's axes: log x for FLOPs, the axis names, legend and grid."""
    if x == "flops":
        ax.set_xscale("log")
    ax.set_xlabel(CURVE_AXES[x])
    ax.set_ylabel("val bpb" if metric == "val/bpb" else "val loss (nats/token)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def plot_all(runs: list[Run], summaries: list[dict], out: Path, mqar_points: list[dict] | None = None) -> list[Path]:
    """mqar_points: the summaries the MQAR plots show (default: every run's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(out / name)

    bpb = "val/bpb" if all(s["val_bpb"] is not None for s in summaries) else "val/loss"
    for name, x, metric in (("val_loss_tokens.png", "tokens", "val/loss"), ("val_loss_time.png", "time", "val/loss"),
                            ("val_bpb_flops.png", "flops", bpb), ("val_bpb_time.png", "time", bpb)):
        curves = [(s["run"], pts) for run, s in zip(runs, summaries) if (pts := curve(run, s, x, metric))]
        if not curves:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, pts in curves:
            ax.plot(*zip(*pts), "o-", ms=3, label=label)
        style_curve_axes(ax, x, metric)
        save(fig, name)

    tput = [s for s in summaries if s["tokens_per_sec"]]
    if tput:
        fig, ax = plt.subplots(figsize=(max(5, 0.7 * len(tput) + 2), 4))
        ax.bar(range(len(tput)), [s["tokens_per_sec"] for s in tput], color="tab:blue")
        ax.set_xticks(range(len(tput)), [s["run"] + (f"\nMFU {100 * s['mfu']:.1f}%" if s["mfu"] else "") for s in tput],
                     rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("training tokens/s")
        save(fig, "throughput.png")

    moe = [(s["run"], r) for run, s in zip(runs, summaries) for r in [next((r for r in reversed(run.rows)
                                                                           if any(LOAD.match(k) for k in r)), None)] if r]
    if moe:
        fig, axes = plt.subplots(len(moe), 1, figsize=(7, 0.5 + 1.4 * len(moe)), squeeze=False)
        for ax, (name, row) in zip(axes[:, 0], moe):
            layers = sorted(int(m.group(1)) for k in row if (m := LOAD.match(k)))
            grid = np.array([row[f"moe/layer{i}/load"] for i in layers], dtype=float)
            im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0)
            ax.set_yticks(range(len(layers)), [f"layer {i}" for i in layers], fontsize=7)
            ax.set_title(f"{name} (step {row['step']}, uniform = {1 / grid.shape[1]:.3f})", fontsize=8)
            fig.colorbar(im, ax=ax)
        axes[-1, 0].set_xlabel("expert")
        save(fig, "moe_load.png")

    mqar = [s for s in (summaries if mqar_points is None else mqar_points) if s["mqar_acc"] is not None]
    if mqar:
        for xkey, name, xlabel in (("state_size", "mqar_state.png", "recurrent state size (numbers per sequence)"),
                                   ("d_model", "mqar_width.png", "d_model")):
            fig, ax = plt.subplots(figsize=(6.5, 4.5))
            for mixer in sorted({s["mixer"] for s in mqar}):
                pts = sorted((s[xkey], s["mqar_acc"]) for s in mqar if s["mixer"] == mixer and s[xkey])
                ax.plot(*zip(*pts), "o-", label=mixer)
            style_mqar_axes(ax, xlabel)
            save(fig, name)
    return written


def style_mqar_axes(ax, xlabel: str) -> None:
    """zoology's MQAR plot: accuracy in [0, 1] against a log2 axis (state size or width)."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MQAR accuracy (mean over slices)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


# ---- best over a swept key ---------------------------------------------------------------------------
RUN_ONLY = ("seed", "run_dir", "resume", "init_from", "name")  # a run's own keys: not in the command that extends a grid
RUN_KEYS = (*RUN_ONLY, "logger")  # differ between runs of one architecture
BUDGET_KEYS = ("trainer.flops_budget", "trainer.tokens_budget", "trainer.max_steps")
EDGE_TAG = "best-on-grid-edge"  # the W&B tag of the runs at a flagged architecture's best value


@dataclass
class Architecture:
    label: str
    score: str  # "mqar_acc" (higher is better) or "val_loss" (lower is better)
    runs: dict = field(default_factory=dict)  # KEY value -> [summary of each seed's run]
    summary: dict = field(default_factory=dict)  # the first run's summary (mixer, d_model, state_size, ...)
    members: dict = field(default_factory=dict)  # KEY value -> [Run of each seed]
    config: dict = field(default_factory=dict)  # the flat config its runs share (without KEY and RUN_KEYS)

    @property
    def points(self) -> dict:
        """KEY value -> [score of each seed]."""
        return {v: [s[self.score] for s in summaries] for v, summaries in self.runs.items()}

    def means(self) -> dict:
        return {v: statistics.mean(scores) for v, scores in sorted(self.points.items())}

    def compared_seeds(self) -> set:
        """The seeds that ran at every value (empty where none did)."""
        return set.intersection(*({cfg_get(r.config, "seed") for r in runs} for runs in self.members.values()))

    def matched_means(self) -> dict:
        """KEY value -> mean score over compared_seeds (over every seed where no seed ran at every value):
        two seeds at one lr against one at another would pit a seed's luck against the lr."""
        seeds = self.compared_seeds()
        return {v: statistics.mean(s[self.score] for s, r in zip(self.runs[v], self.members[v])
                                   if not seeds or cfg_get(r.config, "seed") in seeds) for v in sorted(self.runs)}

    def best(self):
        means = self.matched_means()
        pick = max if self.score == "mqar_acc" else min
        return pick(means, key=means.get)

    def edge(self) -> tuple[str | None, list]:
        return grid_edge(list(self.means()), self.best())

    def budget(self) -> str:
        return budget_line([r.config for members in self.members.values() for r in members])


def grid_edge(values: list, best) -> tuple[str | None, list]:
    """Where the best of the swept values lies: (None, []) strictly inside the grid; ("low edge" or "high edge",
    [the value one step beyond it]), the step continuing the grid's ratio at that end (its difference where a value
    there is <= 0); ("single value", [best / 2, best * 2]). Names (non-numeric values) are flagged only as a
    single value, with nothing beyond."""
    values = sorted(set(values))
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if len(values) == 1:
        flag, beyond = "single value", [best / 2, best * 2] if numeric else []
    elif not numeric or values[0] < best < values[-1]:
        return None, []
    else:
        end, inner = (values[0], values[1]) if best == values[0] else (values[-1], values[-2])
        flag, beyond = ("low edge" if best == values[0] else "high edge"), [end * end / inner if end > 0 and inner > 0
                                                                            else 2 * end - inner]
    return flag, [round(v) for v in beyond] if all(isinstance(v, int) for v in values) else beyond


def group_architectures(runs: list[Run], summaries: list[dict], key: str) -> list[Architecture]:
    """Runs grouped by their config without `key` and the per-run keys (RUN_KEYS), in first-seen order; runs at
    different budgets are different architectures (trainer.max_steps is left out where a budget set it)."""
    groups: dict[str, list[tuple[Run, dict]]] = {}
    for run, s in zip(runs, summaries):
        config = json.loads(json.dumps(run.config, default=str))
        parent, _, leaf = key.rpartition(".")
        (cfg_get(config, parent) if parent else config).pop(leaf)
        for k in RUN_KEYS:
            config.pop(k, None)
        if budget(run.config)[0] != "steps":
            config.get("trainer", {}).pop("max_steps", None)
        groups.setdefault(json.dumps(config, sort_keys=True), []).append((run, s))
    archs, seen = [], {}  # label -> the flat config of the first architecture with it
    for config_json, members in groups.items():
        first = members[0][1]
        label = "-".join(str(first[c]) for c in ("mixer", "ffn") if first[c]) + f"-d{first['d_model']}"
        config = flat(json.loads(config_json))
        if label in seen:  # the same blocks with other options: name the options that differ
            base = seen[label]
            label += " " + ",".join(f"{k.rpartition('.')[2]}={value_text(config.get(k))}"
                                    for k in sorted(base.keys() | config.keys()) if base.get(k) != config.get(k))
        seen.setdefault(label, config)
        score = "mqar_acc" if all(s["mqar_acc"] is not None for _, s in members) else "val_loss"
        arch = Architecture(label, score, summary=first, config=config)
        for run, s in members:
            arch.runs.setdefault(cfg_get(run.config, key), []).append(s)
            arch.members.setdefault(cfg_get(run.config, key), []).append(run)
        archs.append(arch)
    return archs


def value_text(v) -> str:
    """A KEY value as the tables print it: numbers in %g (an lr 0.003), anything else as is (a name)."""
    return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def hydra_value(v) -> str:
    if isinstance(v, list):
        return "[" + ",".join(map(hydra_value, v)) + "]"
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def distinguishing_overrides(arch: Architecture, archs: list[Architecture]) -> list[str]:
    """The config entries in which this architecture differs from the others, as train.py overrides: a group's
    choice (mixer=gdn) for its name, the group's options only where they differ among architectures of that choice."""
    def differ(k, among):
        return len({json.dumps(a.config.get(k)) for a in among}) > 1

    out = []
    for k, v in arch.config.items():
        group = k.partition(".")[0]
        choice = arch.config.get(f"{group}.name")
        if not differ(k, archs):
            continue
        if k == f"{group}.name":
            out.append(f"{group}={v}")
        elif choice is None or differ(k, [a for a in archs if a.config.get(f"{group}.name") == choice]):
            out.append(f"{k}={hydra_value(v)}")
    return out


def extension_command(arch: Architecture, archs: list[Architecture], key: str, beyond: list) -> str:
    """scripts/sweep.py with the architecture's overrides (its best run's own command line, else the config entries
    that tell it from the others), KEY at the values beyond the grid, and the same seeds."""
    best = arch.members[arch.best()]
    given = best[0].overrides
    if given is None:
        overrides = distinguishing_overrides(arch, archs)
    else:
        names = [o.lstrip("+~").partition("=")[0] for o in given]
        overrides = [o for o, k in zip(given, names) if k != key and k.split(".")[0] not in RUN_ONLY]
    seeds = sorted({r.config["seed"] for r in best if r.config.get("seed") is not None})
    args = [*overrides, f"{key}={','.join(value_text(v) for v in beyond)}"]
    args += [f"seed={','.join(map(str, seeds))}"] if seeds else []
    return "python scripts/sweep.py " + " ".join(map(shlex.quote, args))


def edge_warning(arch: Architecture, archs: list[Architecture], key: str) -> str | None:
    """One line for an architecture whose best KEY is at the edge of its grid (or the only value swept), with the
    command that extends the grid; None when the best is strictly inside."""
    flag, beyond = arch.edge()
    if flag is None:
        return None
    line = f"{arch.label}: {edge_text(key, arch.best(), list(arch.means()), flag)}"
    return line + (f"; extend it: {extension_command(arch, archs, key, beyond)}" if beyond else "")


def edge_text(key: str, best, values: list, flag: str) -> str:
    """'best trainer.lr 0.02 is at the high edge of the grid (0.005, 0.01, 0.02)' (flag from grid_edge)."""
    where = "the only value swept" if flag == "single value" else f"at the {flag} of the grid"
    return f"best {key} {value_text(best)} is {where} ({', '.join(value_text(v) for v in sorted(values))})"


def best_over_table(archs: list[Architecture], key: str) -> str:
    lines = [f"| architecture | score | best {key} | edge | mean | min-max | seeds | mean at every {key} (seeds compared) |",
             "|---|---|---|---|---|---|---|---|"]
    for a in archs:
        best = a.best()
        scores = a.points[best]
        every = ", ".join(f"{value_text(v)}: {m:.4g}" for v, m in a.matched_means().items())
        compared = ", ".join(value_text(s) for s in sorted(a.compared_seeds(), key=str)) or "all"
        lines.append(f"| {a.label} | {a.score} | {value_text(best)} | {a.edge()[0] or '-'} | {statistics.mean(scores):.4g} | "
                     f"{min(scores):.4g}-{max(scores):.4g} | {len(scores)} | {every} ({compared}) |")
    return "\n".join(lines)


def best_over_sections(archs: list[Architecture], key: str) -> tuple[list[str], list[str]]:
    """compare.md's best-KEY tables, one pair per budget (one in all when KEY is a budget), each flagged
    architecture's warning in bold under its table; and the warnings."""
    by_budget: dict[str, list[Architecture]] = {}
    for a in archs:
        by_budget.setdefault("" if key in BUDGET_KEYS else a.budget(), []).append(a)
    md, warnings = [], []
    for budget_text, group in by_budget.items():
        lines = [w for a in group if (w := edge_warning(a, archs, key))]
        warnings += lines
        md += [f"## Best {key} per architecture" + (f", {budget_text}" if budget_text else ""), "",
               best_over_table(group, key), "", *[f"**Warning: {w}**\n" for w in lines],
               f"score: MQAR accuracy (higher is better) or val loss (lower is better) at the last evaluation, "
               f"mean and min-max over seeds at the best {key}, which is picked on the seeds that ran at every {key} "
               f"(the means at every {key}); edge: the best is the lowest or highest {key} swept "
               f"(or the only one): the optimum may lie beyond. Every point is in best_{key.replace('.', '_')}/"
               f"<architecture>.png and in the table of every run.", "", f"At the best {key}, means over seeds:", "",
               at_best_table(group, key), ""]
    return md, warnings


def edge_report(archs: list[Architecture], key: str) -> list[dict]:
    """best_over.json: per architecture its budget, score, best value, mean at every value, edge flag, the values
    beyond the edge and the command that sweeps them, and the runs at its best value."""
    out = []
    for a in archs:
        flag, beyond = a.edge()
        out.append({"architecture": a.label, "key": key, "budget": a.budget(), "score": a.score, "best": a.best(),
                    "means": [[v, m] for v, m in a.matched_means().items()],
                    "seeds_compared": sorted(a.compared_seeds(), key=str), "edge": flag, "beyond": beyond,
                    "command": extension_command(a, archs, key, beyond) if beyond else None,
                    "best_runs": [r.name for r in a.members[a.best()]]})
    return out


def tag_wandb_runs(archs: list[Architecture]) -> list[str]:
    """The W&B tag EDGE_TAG on the API runs at each flagged architecture's best value, off every other API run
    of the comparison; a note for each run whose tags could not be changed."""
    notes = []
    for a in archs:
        flagged = a.edge()[0] is not None
        for value, members in a.members.items():
            for run in (r for r in members if r.handle is not None):
                want = flagged and value == a.best()
                try:
                    if (EDGE_TAG in run.handle.tags) != want:
                        run.handle.tags = [t for t in run.handle.tags if t != EDGE_TAG] + [EDGE_TAG] * want
                        run.handle.update()
                except Exception as e:  # no write access, no network: the report stands without the tag
                    notes.append(f"W&B tag {EDGE_TAG} not {'added to' if want else 'removed from'} {run.name}: {e}")
    return notes


AT_BEST = ("val_bpb", "val_bpb_batch_routing", "moe_imbalance", "moe_dead_experts", "moe_unrouted_frac",
           "moe_token_choice_overlap", "tokens_per_sec", "train_flops")


def at_best_table(archs: list[Architecture], key: str) -> str:
    """Each architecture's runs at its best value: the mean over seeds of the columns any of them has."""
    columns = [c for c in AT_BEST if any(s.get(c) is not None for a in archs for s in a.runs[a.best()])]
    lines = [f"| architecture | best {key} | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for a in archs:
        cells = []
        for c in columns:
            values = [s[c] for s in a.runs[a.best()] if s.get(c) is not None]
            cells.append(fmt(float(statistics.mean(values)) if values else None, c))
        lines.append(f"| {a.label} | {value_text(a.best())} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_best_over(archs: list[Architecture], key: str, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = out / f"best_{key.replace('.', '_')}"
    folder.mkdir(exist_ok=True)
    written = []
    for a in archs:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        means = a.means()
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in means)
        x = {v: v if numeric else i for i, v in enumerate(means)}  # names (a parametrization) sit at 0, 1, ...
        for v, scores in a.points.items():
            ax.plot([x[v]] * len(scores), scores, "o", color="tab:blue", alpha=0.5, ms=4)
        ax.plot([x[v] for v in means], list(means.values()), "-", color="tab:blue")
        best = x[a.best()]
        ax.axvline(best, color="tab:green", ls=":", label=f"best {key} = {value_text(a.best())}")
        log = numeric and all(v > 0 for v in means)
        if len(means) == 1:  # one value: a window around it (matplotlib warns on an empty range)
            ax.set_xlim(*((best / 2, best * 2) if log else (best - 1, best + 1)))
        if log:
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(list(x.values()), [str(v) for v in x], fontsize=8)
        ax.set_xlabel(key)
        ax.set_ylabel("MQAR accuracy" if a.score == "mqar_acc" else "val loss (nats/token)")
        ax.set_title(a.label, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = folder / (re.sub(r"[^A-Za-z0-9._=-]+", "_", a.label) + ".png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written + plot_architectures_together(archs, key, folder) + plot_best_curves(archs, key, folder)


def plot_best_curves(archs: list[Architecture], key: str, folder: Path) -> list[Path]:
    """all_val_bpb_flops.png, all_val_bpb_time.png: each architecture at its best KEY, one line, its seeds' curves averaged
    evaluation by evaluation (seeds of one configuration evaluate at the same steps): val bpb against training
    FLOPs, the equal-compute picture, and against wall-clock seconds."""
    import matplotlib.pyplot as plt

    best = [(a, list(zip(a.members[a.best()], a.runs[a.best()]))) for a in archs]
    metric = "val/bpb" if all(s["val_bpb"] is not None for _, runs in best for _, s in runs) else "val/loss"
    written = []
    for name, x in (("all_val_bpb_flops.png", "flops"), ("all_val_bpb_time.png", "time")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for a, runs in best:
            curves = [c for run, s in runs if (c := curve(run, s, x, metric))]
            if curves:
                pts = [(statistics.mean(c[i][0] for c in curves), statistics.mean(c[i][1] for c in curves))
                       for i in range(min(map(len, curves)))]
                ax.plot(*zip(*pts), "o-", ms=3, label=f"{a.label} ({key} {value_text(a.best())}, {len(curves)} seed(s))")
        if not ax.lines:
            plt.close(fig)
            continue
        style_curve_axes(ax, x, metric)
        fig.tight_layout()
        fig.savefig(folder / name, dpi=120)
        plt.close(fig)
        written.append(folder / name)
    return written


def plot_architectures_together(archs: list[Architecture], key: str, folder: Path) -> list[Path]:
    """all_<score>.png: every architecture's mean score against a numeric KEY on one axis (seeds as
    dots), one plot per score kind with at least two architectures (e.g. val loss against the number of
    experts per router, as Clark et al. 2022 plot it)."""
    import matplotlib.pyplot as plt

    written = []
    for score in ("val_loss", "mqar_acc"):
        group = [a for a in archs if a.score == score]
        if len(group) < 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for a in group for v in a.means()):
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, a in enumerate(group):
            color = f"C{i}"
            for v, scores in a.points.items():
                ax.plot([v] * len(scores), scores, "o", color=color, alpha=0.4, ms=4)
            means = a.means()
            ax.plot(list(means), list(means.values()), "-", color=color, label=a.label)
        if all(v > 0 for a in group for v in a.means()):
            ax.set_xscale("log")
        values = sorted({v for a in group for v in a.means()})
        ax.set_xticks(values, [value_text(v) for v in values])
        ax.minorticks_off()
        ax.set_xlabel(key)
        ax.set_ylabel("MQAR accuracy" if score == "mqar_acc" else "val loss (nats/token)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = folder / f"all_{score}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


# ---- eval.py's suites (length, recall, decode) -----------------------------------------------------------
@dataclass
class EvalPoint:
    label: str
    mixer: str
    reports: list[dict]  # eval.json of each run it stands for (each seed of an architecture at its best value)

    def blocks(self, suite: str) -> list[dict]:
        return [r[suite] for r in self.reports if isinstance(r.get(suite), dict)]


def eval_points(runs: list[Run], summaries: list[dict], archs: list[Architecture]) -> list[EvalPoint]:
    """Under --best-over each architecture at its best value (its seeds' reports averaged), else each run."""
    if archs:
        return [EvalPoint(a.label, str(a.summary["mixer"]), [r.report for r in a.members[a.best()] if r.report])
                for a in archs]
    return [EvalPoint(s["run"], str(s["mixer"]), [run.report] if run.report else []) for run, s in zip(runs, summaries)]


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def decode_rows(report: dict) -> dict:
    """The decode suite's measured rows by context (skipped contexts left out)."""
    return {r["context"]: r for r in (report.get("decode") or {}).get("rows", []) if "skipped" not in r and "context" in r}


def recall_grid(report: dict) -> tuple[list, list]:
    """The recall suite's contexts and its accuracy row at each: passkey (a row over depths) or, for an
    MQAR-trained run, MQAR (seq_len as the context, a row over num_kv_pairs, null where a cell cannot hold)."""
    recall = report.get("recall") or {}
    grid = recall.get("mqar", recall)
    contexts = grid.get("contexts", grid.get("seq_lens", []))
    rows = [[a for a in row if a is not None] for row in grid.get("acc", [])]
    return contexts, rows


def recall_acc_at(report: dict, context) -> float | None:
    """Recall accuracy at one context of the recall suite, the mean over its row (depths, or MQAR's kv pairs)."""
    contexts, rows = recall_grid(report)
    return mean(rows[contexts.index(context)]) if context in contexts and len(rows) == len(contexts) else None


def common_context(reports: list[dict], contexts_of) -> int | None:
    """The largest context every report has (contexts_of(report): its contexts)."""
    sets = [set(contexts_of(r)) for r in reports]
    common = set.intersection(*sets) if sets else set()
    return max(common) if common else None


def length_table(points: list[EvalPoint], header: str) -> str | None:
    """The length suite's loss per band (1x, 2x, ... the training length), mean over a point's reports."""
    rows = [(p, p.blocks("length")) for p in points if p.blocks("length")]
    bands = sorted({b for _, blocks in rows for block in blocks for b in block.get("bands", {})},
                   key=lambda b: float(b.rstrip("x")))
    if not bands:
        return None
    lines = [f"| {header} | " + " | ".join(bands) + " |", "|---" * (len(bands) + 1) + "|"]
    for p, blocks in rows:
        cells = [mean(block.get("bands", {}).get(b) for block in blocks) for b in bands]
        lines.append(f"| {p.label} | " + " | ".join("-" if c is None else f"{c:.4g}" for c in cells) + " |")
    return "\n".join(lines)


def length_curve(blocks: list[dict]) -> tuple[int, list[float]] | None:
    """(the longest length evaluated, mean loss per position there over the blocks that have it)."""
    lengths = [int(k) for b in blocks for k in b.get("per_position", {})]
    if not lengths:
        return None
    curves = [b["per_position"][str(max(lengths))] for b in blocks if str(max(lengths)) in b.get("per_position", {})]
    return max(lengths), [statistics.mean(losses) for losses in zip(*curves)]


def plot_suites(points: list[EvalPoint], out: Path) -> tuple[list[Path], list[str]]:
    """length.png, recall_state.png, recall_throughput.png, decode.png from the points' eval.json blocks (a point
    without a suite's block is left out of its plot); notes for the plots that had nothing in common to show."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written, notes = [], []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(out / name)

    curves = [(p.label, curve, p.blocks("length")) for p in points if (curve := length_curve(p.blocks("length")))]
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, (length, losses), _ in curves:
            ax.plot(*log_binned(losses), lw=1, label=f"{label} (length {length})")
        for t in sorted({b["train_seq_len"] for _, _, blocks in curves for b in blocks if b.get("train_seq_len")}):
            ax.axvline(t, color="gray", ls="--", lw=1, label=f"training length {t}")
        ax.set_xscale("log")
        ax.set_xlabel("position")
        ax.set_ylabel("loss (nats/token)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        save(fig, "length.png")

    mixers = sorted({p.mixer for p in points})
    colors = {m: f"C{i}" for i, m in enumerate(mixers)}
    both = [p for p in points if p.blocks("recall") and p.blocks("decode")]
    reports = [r for p in both for r in p.reports if r.get("recall") and r.get("decode")]
    state_at = common_context(reports, lambda r: set(recall_grid(r)[0]) & set(decode_rows(r)))
    speed_at = common_context(reports, lambda r: decode_rows(r))
    for name, context, x_of, y_of, xlabel, ylabel in (
            ("recall_state.png", state_at, lambda r, c: decode_rows(r)[c].get("cache_bytes"), recall_acc_at,
             "decode-cache bytes per sequence", "recall accuracy (mean over depths)"),
            ("recall_throughput.png", speed_at, lambda r, c: decode_rows(r)[c].get("decode_tokens_per_sec"),
             lambda r, c: next((v for k in ("recall/acc", "recall/mqar_acc") if (v := (r.get("scores") or {}).get(k)) is not None), None),
             "decode tokens/s", "recall accuracy (recall/acc or recall/mqar_acc)")):
        if context is None:
            if both:
                notes.append(f"{name}: no context that every run's recall and decode suites share")
            continue
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for p in both:
            measured = [r for r in p.reports if r.get("recall") and r.get("decode")]
            x, y = mean(x_of(r, context) for r in measured), mean(y_of(r, context) for r in measured)
            if x is None or y is None:
                continue
            ax.plot(x, y, "o", color=colors[p.mixer], label=p.mixer)
            ax.annotate(p.label, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        handles, labels = ax.get_legend_handles_labels()
        by_mixer = dict(zip(labels, handles))  # one legend entry per mixer
        ax.legend(by_mixer.values(), by_mixer.keys(), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel(f"{xlabel} at context {context}")
        ax.set_ylabel(f"{ylabel} at context {context}" if name == "recall_state.png" else ylabel)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        save(fig, name)

    decoded = [p for p in points if p.blocks("decode")]
    if decoded:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for p in decoded:
            by_context = [decode_rows(r) for r in p.reports if r.get("decode")]
            contexts = sorted({c for rows in by_context for c in rows})
            for ax, field_name in zip(axes, ("decode_tokens_per_sec", "cache_bytes")):
                values = [mean(rows[c].get(field_name) for rows in by_context if c in rows) for c in contexts]
                pts = [(c, v) for c, v in zip(contexts, values) if v is not None]
                if pts:
                    ax.plot(*zip(*pts), "o-", ms=3, label=p.label)
        for ax, ylabel in zip(axes, ("decode tokens/s", "decode-cache bytes per sequence")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[1].set_yscale("log")
        axes[0].legend(fontsize=7)
        save(fig, "decode.png")
    return written, notes


def compare(paths: list[Path], out: Path, wandb_path: str | None = None, best_over: str | None = None) -> dict:
    runs, notes = discover(paths)
    if wandb_path:
        runs += read_wandb_api(wandb_path)
    skipped = [r for r in runs if not r.complete or not any("val/loss" in row for row in r.rows)]
    for r in skipped:
        notes.append(f"skipped {r.name} ({r.source}): {r.note or 'no val metrics'}")
    runs = [r for r in runs if r not in skipped]
    missing = [r.name for r in runs if best_over and cfg_get(r.config, best_over) is None]
    if missing:
        raise ValueError(f"--best-over {best_over}: run {missing[0]} has no {best_over} in its config")
    summaries = [summarize_run(r) for r in runs]
    out.mkdir(parents=True, exist_ok=True)
    archs = group_architectures(runs, summaries, best_over) if best_over and runs else []
    for a in archs:
        for at_value in a.runs.values():
            for s in at_value:
                s.update(architecture=a.label, edge=a.edge()[0])
    slice_cols = sorted({k for s in summaries for k in s if k.startswith("mqar_acc/")},
                        key=lambda k: tuple(int(x) for x in k.split("/")[1].split("x")))
    eval_cols = sorted({k for s in summaries for k in s if k.startswith("eval/")})
    columns = COLUMNS[:-2] + slice_cols + eval_cols + (["architecture", "edge"] if archs else []) + COLUMNS[-2:]
    with (out / "compare.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(summaries)
    shown = [c for c in columns if c not in ("source", "budget", "architecture", "edge")
             and any(s.get(c) is not None for s in summaries)]
    best_points = None
    if archs:  # the MQAR plots show each architecture at its best value
        best_points = [{**a.summary, "mqar_acc": a.means()[a.best()] if a.score == "mqar_acc" else None} for a in archs]
        (out / "best_over.json").write_text(json.dumps(edge_report(archs, best_over), indent=1))
        notes += tag_wandb_runs(archs)
    plots = plot_all(runs, summaries, out, best_points) if runs else []
    points = eval_points(runs, summaries, archs)
    suite_plots, suite_notes = plot_suites(points, out)
    md = [f"# Comparison of {len(runs)} run(s)", "", f"Budget: {budget_line([r.config for r in runs])}.", ""]
    warnings = []
    if archs:
        sections, warnings = best_over_sections(archs, best_over)
        md += [*sections, "## Every run", ""]
        plots += plot_best_over(archs, best_over, out)
    md += [markdown_table(summaries, shown) if runs else "(no complete runs)", "",
           "params: total (active per token); train_flops: tokens x train FLOPs per token; tokens/s and MFU: median "
           "over training logs after the first; val metrics at the last evaluation; wall_s: training wall-clock; "
           "state_size: decode-cache numbers per sequence at trainer.seq_len.", ""]
    bands = length_table(points, "architecture" if archs else "run")
    if bands:
        md += ["## Loss by length (eval.py's length suite)", "", bands, "",
               "loss (nats/token) in each length band of eval.py's length suite, in multiples of the training length"
               + (f"; mean over seeds at the best {best_over}" if archs else "") + ".", ""]
    md += [f"![{p.stem}]({p.relative_to(out)})" for p in plots + suite_plots]
    notes += suite_notes
    if notes:
        md += ["", "## Notes", *[f"- {n}" for n in notes]]
    (out / "compare.md").write_text("\n".join(md) + "\n")
    return {"summaries": summaries, "architectures": archs, "notes": notes, "plots": plots + suite_plots,
            "warnings": warnings, "markdown": "\n".join(md)}


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
