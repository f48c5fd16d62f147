"""W&B as the comparison surface, read back from the offline run files that train.py, scripts/sweep.py
and eval.py write: tags that are always valid (a 24-layer hybrid with MoE), one group per sweep,
job_type, metric definitions, the summary, plots and the expert-load table, evaluations in the
training run, and compare.py reading all of it."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, TINY, run_train
from analysis.report import compare
from analysis.wandb_runs import wandb_records
from runs.config import compose
from runs.tracking import architecture, run_tags, schedule_tag

HYBRID_24 = "[" + ",".join(["softmax", "gdn", "gdn", "gdn"] * 6) + "]"


def offline_run(folder: Path) -> dict:
    """What an offline W&B run folder holds: the run record, metric definitions, the last summary
    values, history keys, and the files written under files/."""
    out = {"metrics": {}, "summary": {}, "history_keys": set(), "history": []}
    for record in wandb_records(next(folder.glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run"] = record.run
        elif kind == "metric":
            out["metrics"][record.metric.name or record.metric.glob_name] = record.metric
        elif kind == "summary":
            out["summary"].update({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.summary.update})
        elif kind == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            out["history"].append(row)
            out["history_keys"] |= set(row)
    out["files"] = sorted(str(p.relative_to(folder / "files")) for p in (folder / "files").rglob("*") if p.is_file())
    return out


def test_schedule_tag_and_architecture():
    assert schedule_tag(["gdn"] * 12) == "gdn"
    assert schedule_tag(["softmax", "gdn", "gdn", "gdn"] * 6) == "gdn:softmax 3:1"
    assert schedule_tag(["dense", "moe", "moe", "moe", "mamba2", "mamba2"]) == "moe:mamba2:dense 3:2:1"
    every = ["derived_gdn", "mamba2", "softmax", "linear", "gdn", "dsa"]
    assert len(schedule_tag([k for i, k in enumerate(every) for _ in range(i + 1)])) <= 64
    cfg = compose(["model.num_hidden_layers=24", f"model.mixer={HYBRID_24}", "ffn=moe", "seed=3", "trainer.lr=3e-3"])
    assert architecture(cfg) == "gdn:softmax 3:1-moe-tiny"
    assert run_tags(cfg) == ["gdn:softmax 3:1", "moe", "tiny", "muon", "lr=0.003", "seed=3"]


@pytest.mark.slow
def test_hybrid_moe_run_carries_group_tags_metrics_summary_and_media(tmp_path, data_cache):
    """The 24-layer hybrid + MoE run that used to die on a 96-character tag."""
    run = tmp_path / "run"
    # a process of its own: what the test reads is the offline W&B files a finished run leaves
    run_train(run, "logger=wandb", "model.num_hidden_layers=24", f"model.mixer={HYBRID_24}", "ffn=moe",
              "model.hidden_size=32", "model.num_attention_heads=2", "model.num_key_value_heads=2",
              "trainer.seq_len=32", "trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_batches=1",
              "trainer.sample_tokens=0", cache=data_cache, env={"WANDB_MODE": "offline"})
    w = offline_run(next((run / "wandb").glob("offline-run-*")))
    assert w["run"].run_group == "softmax-moe-tiny"  # a single run: the run name (no experiment)
    assert w["run"].job_type == "gdn:softmax 3:1-moe-tiny"
    assert list(w["run"].tags) == ["gdn:softmax 3:1", "moe", "tiny", "muon", "lr=0.01", "seed=0"]
    # tokens_seen is the x-axis; val/loss and val/bpb are summarised by their minimum
    for name in ("train/*", "val/*", "perf/*", "moe/*", "val/loss", "val/bpb"):
        assert w["metrics"][name].step_metric == "tokens_seen", name
    assert w["metrics"]["val/loss"].summary.min and w["metrics"]["val/bpb"].summary.min
    s = w["summary"]
    assert s["params/total"] > s["params/active"] > 0
    assert s["best/val_loss"] == pytest.approx(min(r["val/loss"] for r in w["history"] if "val/loss" in r))
    assert {"best/val_bpb", "perf/median_tokens_per_sec", "perf/median_mfu", "time/wall_s"} <= set(s)
    # one scalar per layer and expert, no histograms
    assert {f"moe/layer{i}/expert{e}/load" for i in (0, 23) for e in range(8)} <= w["history_keys"]
    assert not any(isinstance(v, dict) and v.get("_type") == "histogram" for r in w["history"] for v in r.values())
    # the end-of-run plots as images and the load table
    images = {re.sub(r"_\d+_[0-9a-f]+\.png$", "", f) for f in w["files"] if f.endswith(".png")}
    assert images == {"media/images/plots/loss", "media/images/plots/moe_load_heatmap", "media/images/plots/moe_imbalance"}
    table_file = next(f for f in w["files"] if f.endswith(".table.json"))
    table = json.loads((next((run / "wandb").glob("offline-run-*")) / "files" / table_file).read_text())
    assert table["columns"] == ["step", "tokens_seen", "layer", "expert", "load"]
    assert len(table["data"]) == 24 * 8 * 2  # every layer and expert at each of the 2 logged steps
    assert {row[2] for row in table["data"]} == set(range(24))


@pytest.mark.slow
def test_sweep_is_one_group_and_eval_lands_in_the_run(tmp_path, data_cache, capsys, monkeypatch):
    """scripts/sweep.py, two architectures x two lrs, W&B offline: one group shared by the four runs
    (the one the sweep printed), job_type per architecture, lr in the tags; eval.py logs into one
    run under eval/; compare.py reads the group and the eval column from the offline folders alone.
    The sweep runs in this process (its train.py jobs in their own), as `python -m scripts.sweep ...`."""
    import os

    from scripts import sweep

    out = tmp_path / "sweep"
    tiny = [o for o in TINY if not o.startswith(("logger=", "trainer.max_steps", "trainer.sample_tokens", "trainer.eval_every"))]
    env = {**os.environ, "SWAPLM_CACHE": str(data_cache), "WANDB_MODE": "offline"}
    monkeypatch.setenv("SWAPLM_CACHE", str(data_cache))
    monkeypatch.setenv("WANDB_MODE", "offline")
    rc = sweep.main(["ffn=moe", "model.mixer=[gdn,softmax],[gdn,gdn]", "trainer.lr=1e-3,3e-3", *tiny, "trainer.max_steps=2",
                     "trainer.eval_every=2", "trainer.sample_tokens=0", "logger=wandb", "--launcher", "python", "--jobs", "2",
                     "--out", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0, stdout[-3000:]
    group = re.search(r"W&B group \(with logger=wandb\): (\S+)", stdout).group(1)
    runs = sorted(p for p in out.iterdir() if p.is_dir())
    assert len(runs) == 4
    seen = [offline_run(next((r / "wandb").glob("offline-run-*"))) for r in runs]
    assert {w["run"].run_group for w in seen} == {group} and group.startswith("sweep-")
    assert [w["run"].job_type for w in seen] == ["gdn:softmax 1:1-moe-tiny"] * 2 + ["gdn-moe-tiny"] * 2
    assert [t for w in seen for t in w["run"].tags if t.startswith("lr=")] == ["lr=0.001", "lr=0.003"] * 2
    for w in seen:
        assert w["metrics"]["val/loss"].summary.min and "best/val_loss" in w["summary"]
        assert any(f.endswith(".table.json") for f in w["files"]) and any("moe_load_heatmap" in f for f in w["files"])

    proc = subprocess.run([sys.executable, "eval.py", f"checkpoint={runs[0]}", "batches=2", "batch_size=4",
                           "sample_tokens=4", "num_samples=1"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    scores = json.loads((runs[0] / "final" / "eval" / "eval.json").read_text())["scores"]
    folders = sorted((runs[0] / "wandb").glob("offline-run-*"))
    assert len(folders) == 2  # training, then eval.py continuing the same run id
    run_id = (runs[0] / "wandb_run_id").read_text().strip()
    assert all(f.name.endswith(run_id) for f in folders)
    logged = offline_run(folders[1])["summary"]
    assert logged["eval/val/loss"] == pytest.approx(scores["val/loss"]) and "eval/per_position_loss" in logged

    # compare.py from the offline W&B folders only (no metrics.jsonl): one run per run id, eval merged in
    offline_only = tmp_path / "offline"
    for r in runs:
        for f in (r / "wandb").glob("offline-run-*"):
            (offline_only / r.name).mkdir(parents=True, exist_ok=True)
            os.symlink(f, offline_only / r.name / f.name)
    result = compare([offline_only], tmp_path / "report")
    summaries = result["summaries"]
    assert len(summaries) == 4 and {s["group"] for s in summaries} == {group}
    assert summaries[0]["eval/val/loss"] == pytest.approx(scores["val/loss"])
    assert all(s.get("eval/val/loss") is None for s in summaries[1:])
    assert "eval/val/loss" in (tmp_path / "report" / "compare.csv").read_text().splitlines()[0]
    assert (tmp_path / "report" / "moe_load.png").exists()  # rebuilt from the per-expert scalars
