"""Per-run numbers: one summary row per run (its blocks, parameters, tokens, training FLOPs, val metrics,
throughput, MoE routing, MQAR accuracy and decode-state size, state-tracking accuracy by length band), the budget it
trained for, its curves."""
import json

from analysis.runs import Run, cfg_get
from runs.flops import training_flops_per_token
from runs.metrics import logged, median_after_first
from runs.tracking import schedule_tag

COLUMNS = ["run", "group", "mixer", "ffn", "d_model", "layers", "params_total", "params_active", "tokens", "train_flops", "budget", "val_loss",
           "val_ppl", "val_bpb", "val_bpb_batch_routing", "tokens_per_sec", "mfu", "peak_mem_gb", "wall_s",
           "moe_imbalance", "moe_dead_experts", "moe_unrouted_frac", "moe_token_choice_overlap", "mqar_acc",
           "state_acc", "state_size", "source"]
CURVE_AXES = {"tokens": "tokens seen", "time": "wall-clock (s)",
              "flops": "training FLOPs (tokens seen x train FLOPs per token)"}


def build_model(config: dict, meta: bool):
    """DecoderLM of a resolved train.py config (vocab from data.vocab_size)."""
    import torch
    from omegaconf import OmegaConf

    from model import DecoderLM
    from runs.config import lm_config

    cfg = OmegaConf.create(config)
    with torch.device("meta") if meta else torch.device("cpu"):
        return DecoderLM(lm_config(cfg, cfg.data.vocab_size, None))


STATE_SIZES: dict[str, int] = {}  # architecture (JSON) -> state_size


def state_size(config: dict) -> int:
    """decode_state_numbers of the run's model at trainer.seq_len (computed once per architecture: runs of an lr or
    seed sweep share it)."""
    shape = json.dumps({**{k: config.get(k) for k in ("model", "mixer", "ffn")}, "seq_len": config["trainer"]["seq_len"],
                        "vocab": cfg_get(config, "data.vocab_size")}, sort_keys=True, default=str)
    if shape not in STATE_SIZES:
        STATE_SIZES[shape] = decode_state_numbers(build_model(config, meta=False), config["trainer"]["seq_len"])
    return STATE_SIZES[shape]


def decode_state_numbers(model, seq_len: int) -> int:
    """Numbers in the model's decode cache of one sequence after seq_len tokens, summed over layers (the cache's
    bytes over the model's element size: the cache holds the model's dtype)."""
    import torch

    from model.lm import DecodeCache

    cache = DecodeCache(model.config.num_hidden_layers)
    with torch.no_grad():
        model.eval()(input_ids=torch.zeros(1, seq_len, dtype=torch.long), past_key_values=cache, use_cache=True)
    return cache.nbytes() // next(model.parameters()).element_size()


def last(rows: list[dict], key: str):
    values = logged(rows, key)
    return values[-1] if values else None


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
        device = run.info.get("device", "cpu").partition(":")[0]  # every part trained, as runs then were charged
        run.info["train_flops_per_token"] = training_flops_per_token(build_model(c, meta=True), c["trainer"]["seq_len"],
                                                                     device, trains=lambda p: True)
    flops_per_token, tokens = run.info.get("train_flops_per_token"), last(rows, "tokens_seen")
    train_flops = last(rows, "flops_seen")  # an objective's stages may cost apart: the loop's own count
    if train_flops is None and tokens is not None and flops_per_token:
        train_flops = tokens * flops_per_token
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
        "tokens": tokens, "train_flops": train_flops,
        "train_flops_per_token": flops_per_token, "val_loss": last(rows, "val/loss"), "val_ppl": last(rows, "val/ppl"),
        "val_bpb": last(rows, "val/bpb"), "tokens_per_sec": median_after_first(rows, "perf/tokens_per_sec"),
        "mfu": median_after_first(rows, "perf/mfu"),
        "peak_mem_gb": max(logged(rows, "perf/peak_mem_gb"), default=None),
        "wall_s": clock[-1][1] if clock else None, "moe_imbalance": last(rows, "moe/imbalance"),
        "val_bpb_batch_routing": last(rows, "val/batch_routing/bpb"), "moe_dead_experts": last(rows, "moe/dead_experts"),
        "moe_unrouted_frac": last(rows, "moe/unrouted_frac"), "moe_token_choice_overlap": last(rows, "moe/token_choice_overlap"),
        "mqar_acc": last(rows, "val/mqar_acc"), "state_size": None, "state_acc": last(rows, "val/state_acc"),
        "group": run.group or None, "source": run.source,
        "budget": budget(c)[1], **{k: v for k, v in run.summary.items() if k.startswith("eval/") and isinstance(v, (int, float))},
    }
    if s["mqar_acc"] is not None and c:
        s["state_size"] = state_size(c)
        s.update(last_slices(rows, "mqar_acc"))
    if s["state_acc"] is not None:  # data/state_tracking.py's length bands; chance: 1 / the group's order
        order = run.info.get("data_info", {}).get("group_order")
        s.update(last_slices(rows, "state_acc"), state_chance=1 / order if order else None)
    return s


def last_slices(rows: list[dict], score: str) -> dict:
    """The slices (val/<score>/<slice>) logged with the last val/<score>, keyed <score>/<slice>."""
    final = next(r for r in reversed(rows) if f"val/{score}" in r)
    return {k.removeprefix("val/"): v for k, v in final.items() if k.startswith(f"val/{score}/")}


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
