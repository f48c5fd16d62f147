"""Sweeps (Hydra -m and scripts/sweep.py) and scripts/compare.py on fixture runs (local run dirs and
a real offline W&B run)."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import ROOT, TINY
from model import DecoderLM
from analysis import best, summary
from analysis.report import compare, discover
from analysis.runner import launcher_command
from analysis.runs import Run
from runs import sweep
from runs.config import compose, lm_config
from runs.metrics import read_metrics
from scripts import compare as compare_script, sweep as sweep_script


# ---- sweeps ----------------------------------------------------------------------------------------
def test_expand_grid_and_names():
    overrides = ["mixer=softmax,gdn", "trainer.lr=1e-3", "model.mixer=[gdn,softmax],[softmax,gdn]"]
    grid = sweep.expand_grid(overrides)
    assert grid == [
        ["mixer=softmax", "trainer.lr=1e-3", "model.mixer=[gdn,softmax]"],
        ["mixer=softmax", "trainer.lr=1e-3", "model.mixer=[softmax,gdn]"],
        ["mixer=gdn", "trainer.lr=1e-3", "model.mixer=[gdn,softmax]"],
        ["mixer=gdn", "trainer.lr=1e-3", "model.mixer=[softmax,gdn]"],
    ]
    assert sweep.job_name(grid[1], overrides) == "softmax-_softmax_gdn_"
    with pytest.raises(ValueError, match="not key=value"):
        sweep.expand_grid(["mixer"])
    # Hydra's sweep functions expand as Hydra's basic sweeper runs them (train.py -m's check sees its jobs)
    assert sweep.expand_grid(["trainer.warmup_steps=range(1,3)", "mixer=choice(gdn,softmax)", "~logger.group"]) == [
        ["trainer.warmup_steps=1", "mixer=gdn", "~logger.group"], ["trainer.warmup_steps=1", "mixer=softmax", "~logger.group"],
        ["trainer.warmup_steps=2", "mixer=gdn", "~logger.group"], ["trainer.warmup_steps=2", "mixer=softmax", "~logger.group"]]


def test_match_params_equalises_active_counts():
    """model.intermediate_size is chosen so that active params are the closest to the reference's."""
    base = ["model.hidden_size=64", "model.num_attention_heads=4", "model.num_key_value_heads=4", "data.vocab_size=512"]
    target = sweep_script.parameter_counts(compose(base + ["mixer=softmax"]))["active"]
    cfg = compose(base + ["mixer=mamba2"])
    size = sweep_script.match_intermediate_size(cfg, target, "active")
    counts = [sweep_script.parameter_counts(cfg, i)["active"] for i in (size - 16, size, size + 16)]
    assert abs(counts[1] - target) == min(abs(c - target) for c in counts) and abs(counts[1] - target) / target < 0.02
    moe = compose(base + ["mixer=softmax", "ffn=moe"])
    assert abs(sweep_script.parameter_counts(moe, sweep_script.match_intermediate_size(moe, target, "active"))["active"] - target) / target < 0.02


@pytest.mark.slow
def test_hydra_multirun_writes_every_job_and_compare_reads_them(tmp_path, data_cache):
    """python train.py -m mixer=softmax,gdn (W&B offline): two jobs with the same data, seed and
    tokens, each at its mixer's tuned lr, two complete runs; then the compare.py CLI tables both (their
    wandb/ folders not twice)."""
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "-m", *TINY, "trainer.max_steps=4", "logger=wandb",
                           "logger.mode=offline", "+experiment_name=tiny_sweep", "mixer=softmax,gdn",
                           f"hydra.sweep.dir={sweep_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(p for p in sweep_dir.iterdir() if (p / "metrics.jsonl").exists())
    assert [p.name for p in runs] == ["0_softmax-dense-tiny", "1_gdn-dense-tiny"]
    configs = [yaml.safe_load((p / "config.yaml").read_text()) for p in runs]
    for c in configs:
        assert c["trainer"]["lr"] == c["mixer"]["lr"][c["optimizer"]["name"]]
    assert configs[0]["trainer"]["lr"] != configs[1]["trainer"]["lr"]  # softmax and gdn are tuned apart
    assert {**configs[0]["trainer"], "lr": None} == {**configs[1]["trainer"], "lr": None}
    assert configs[0]["seed"] == configs[1]["seed"] and configs[0]["data"] == configs[1]["data"]
    # one W&B group for the sweep: the experiment and the sweep folder
    groups = [json.loads((p / "run_info.json").read_text())["group"] for p in runs]
    assert groups[0] == groups[1] == f"tiny_sweep-{tmp_path.name}_sweep"
    for p in runs:
        assert (p / "final" / "model.safetensors").exists() and list(p.glob("wandb/offline-run-*"))
        assert read_metrics(p)[-1]["tokens_seen"] == 4 * 4 * 64

    proc = subprocess.run([sys.executable, "-m", "scripts.compare", str(sweep_dir), "--out", str(tmp_path / "r")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader((tmp_path / "r" / "compare.csv").open()))
    assert [(r["run"], r["mixer"], r["group"]) for r in rows] == [("0_softmax-dense-tiny", "softmax", groups[0]),
                                                                  ("1_gdn-dense-tiny", "gdn", groups[0])]
    for r, p in zip(rows, runs):
        assert float(r["val_loss"]) == pytest.approx(read_metrics(p)[-1]["val/loss"])
        assert int(r["params_total"]) == json.loads((p / "run_info.json").read_text())["params"]["total"]


@pytest.mark.slow
def test_sweep_continues_past_a_failed_job(tmp_path, data_cache, capsys):
    """sweep.py, two jobs at once: job 1 fails as it starts (its init_from does not exist, which only the run
    finds out: the config checks pass), job 0 still completes; the summary names the failure and the exit status is 1."""
    out = tmp_path / "sweep"
    missing = tmp_path / "no_such_run"
    rc = sweep_script.main([*TINY, "trainer.max_steps=2", f"init_from=null,{missing}", "--launcher", "python", "--jobs", "2",
                     "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 1
    jobs = json.loads((out / "sweep.json").read_text())
    failed = f"1_{str(missing).replace('/', '_')}"  # job_name keeps [A-Za-z0-9._=-]
    assert [(j["name"], j["status"]) for j in jobs] == [("0_null", "ok"), (failed, "failed")]
    assert jobs[0]["val_loss"] > 0 and (out / "0_null" / "final").exists() and not (out / failed / "final").exists()
    assert str(missing) in (out / f"{failed}.log").read_text()
    assert f"1/2 ok; not ok: {failed}" in text and "compare: python scripts/compare.py" in text


def test_sweep_launcher_commands():
    assert launcher_command("accelerate", "configs/accelerate/multi_gpu.yaml", 4)[1:] == [
        "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/multi_gpu.yaml", "--num_processes", "4"]
    assert launcher_command("python") == [sys.executable]


# ---- compare ---------------------------------------------------------------------------------------
def tiny_config(*overrides) -> dict:
    cfg = compose(["model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
                         "model.num_key_value_heads=2", "model.intermediate_size=64", "data.vocab_size=64",
                         "trainer.seq_len=32", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def write_run(folder, config, rows, params=None, final=True):
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if params:
        (folder / "run_info.json").write_text(json.dumps({"params": params}))
    if final:
        (folder / "final").mkdir()


def train_rows(tok_s, losses, elapsed=True, extra=None):
    rows = []
    for i, loss in enumerate(losses, 1):
        row = {"step": 10 * i, "train/loss": loss + 0.1, "perf/tokens_per_sec": tok_s[i - 1], "perf/step_time": 0.5,
               "perf/mfu": 0.01 * i, "perf/peak_mem_gb": 0.1 * i, "tokens_seen": 10 * i * 256,
               "val/loss": loss, "val/ppl": 2.718281828 ** loss, **(extra or {})}
        if elapsed:
            row["time/elapsed"] = 7.0 * i
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def offline_wandb_run(tmp_path_factory):
    """A real offline W&B run (what train.py logger=wandb writes under <run_dir>/wandb/)."""
    import wandb

    folder = tmp_path_factory.mktemp("wandb")
    config = tiny_config("mixer=mamba2")
    run = wandb.init(mode="offline", dir=str(folder), project="p", group="g", name="wb-mamba2",
                     config={**config, "params": {"total": 1234, "active": 1000}})
    for i, loss in enumerate([3.0, 2.5, 2.25], 1):
        run.log({"train/loss": loss, "val/loss": loss, "tokens_seen": 100 * i, "perf/tokens_per_sec": 50.0 * i,
                 "moe/layer0/load": wandb.Histogram([0.5, 0.5])}, step=5 * i)
    run.finish()
    return next(folder.glob("wandb/offline-run-*"))


@pytest.mark.slow
def test_compare_table_and_plots(tmp_path, offline_wandb_run):
    runs = tmp_path / "runs"
    write_run(runs / "a_softmax", tiny_config(), train_rows([100, 200, 300, 400], [4.0, 3.5, 3.0, 2.5]),
              params={"total": 5000, "active": 5000})
    moe_extra = {"moe/imbalance": 1.5, "moe/layer0/load": [0.5, 0.25, 0.25, 0.0], "moe/layer1/load": [0.25] * 4}
    write_run(runs / "b_gdn_moe", tiny_config("mixer=gdn", "ffn=moe", "ffn.options.num_experts=4"),
              train_rows([50, 60, 70], [4.0, 3.8, 3.6], elapsed=False, extra=moe_extra))  # no run_info: rebuilt
    write_run(runs / "c_unfinished", tiny_config(), train_rows([1], [5.0]), final=False)
    mqar = [{**r, "val/mqar_acc": 0.5, "val/mqar_acc/32x4": 0.75, "val/mqar_acc/32x8": 0.25}
            for r in train_rows([10, 10], [1.0, 0.5])]
    write_run(runs / "d_mqar", tiny_config("experiment=mqar", "trainer.seq_len=32", "data.vocab_size=64"), mqar)
    for where, bpb in (("final", 1.25), ("checkpoints/step_0000020", 1.5)):  # eval.py's reports
        (runs / "a_softmax" / where / "eval").mkdir(parents=True)
        (runs / "a_softmax" / where / "eval" / "eval.json").write_text(json.dumps({"scores": {"val/bpb": bpb}}))
    # offline W&B run inside a run dir with metrics.jsonl is not read twice
    (runs / "a_softmax" / "wandb").symlink_to(offline_wandb_run.parent)

    out = tmp_path / "report"
    result = compare([runs, offline_wandb_run], out)
    rows = {r["run"]: r for r in csv.DictReader((out / "compare.csv").open())}
    assert set(rows) == {"a_softmax", "b_gdn_moe", "d_mqar", "wb-mamba2"}
    a, b, d, w = rows["a_softmax"], rows["b_gdn_moe"], rows["d_mqar"], rows["wb-mamba2"]
    assert float(a["val_loss"]) == 2.5 and int(a["tokens"]) == 40 * 256 and int(a["params_total"]) == 5000
    assert float(a["tokens_per_sec"]) == 300  # median of the logs after the first
    assert float(a["peak_mem_gb"]) == pytest.approx(0.4) and float(a["wall_s"]) == 28.0
    assert float(b["wall_s"]) == 15.0  # no time/elapsed: cumulated step_time x steps
    assert (b["mixer"], b["ffn"], float(b["moe_imbalance"])) == ("gdn", "moe", 1.5)
    built = DecoderLM(lm_config(OmegaConf.create(tiny_config("mixer=gdn", "ffn=moe", "ffn.options.num_experts=4")),
                                64, None)).parameter_counts()
    assert (int(b["params_total"]), int(b["params_active"])) == (built["total"], built["active"])
    assert built["total"] > built["active"]
    # MQAR: softmax state = K and V of every layer at trainer.seq_len = 2 layers x 2 x 32 x d_model 32
    assert float(d["mqar_acc"]) == 0.5 and float(d["mqar_acc/32x4"]) == 0.75 and int(d["state_size"]) == 2 * 2 * 32 * 32
    assert float(w["val_loss"]) == 2.25 and int(w["tokens"]) == 300 and int(w["params_active"]) == 1000
    assert w["mixer"] == "mamba2" and float(w["wall_s"]) > 0
    md = (out / "compare.md").read_text()
    assert "skipped c_unfinished" in md and "no final/" in md and "| a_softmax | - | softmax | dense |" in md
    assert w["group"] == "g" and a["group"] == ""
    assert (float(a["eval/val/bpb"]), float(a["eval/step_0000020/val/bpb"]), w["eval/val/bpb"]) == (1.25, 1.5, "")
    for png in ("val_loss_tokens", "val_loss_time", "throughput", "moe_load", "mqar_state", "mqar_width"):
        assert (out / f"{png}.png").stat().st_size > 1000, png
    assert len(result["summaries"]) == 4


@pytest.mark.slow
def test_compare_reads_wandb_api(tmp_path, monkeypatch):
    """--wandb ENTITY/PROJECT/GROUP: runs come from wandb.Api().runs(project, filters={'group': ...}) (a
    stand-in here: no network); history rows map _step/_runtime, unfinished runs are skipped with a note."""
    import wandb

    class FakeRun:
        def __init__(self, name, state, config, history):
            self.name, self.state, self.url = name, state, f"https://wandb.ai/e/p/runs/{name}"
            self.config, self._history = {**config, "_wandb": {"x": 1}}, history
            self.group, self.summary = "g", {"eval/val/bpb": 1.25, "eval/step_0000004/val/bpb": 1.5, "train/loss": 2.0}

        def scan_history(self):
            return iter(self._history)

    history = [{"_step": 10 * i, "_runtime": 3.0 * i, "train/loss": 4.0 - i, "val/loss": 3.9 - i, "tokens_seen": 2560 * i,
                "perf/tokens_per_sec": 100.0 * i, "moe/layer0/load": {"_type": "histogram"}} for i in (1, 2)]
    asked = {}

    class FakeApi:
        def runs(self, path, filters):
            asked.update(path=path, filters=filters)
            return [FakeRun("api-gdn", "finished", {**tiny_config("mixer=gdn"), "params": {"total": 9, "active": 8}},
                            history),
                    FakeRun("api-running", "running", tiny_config(), history[:1])]

    monkeypatch.setattr(wandb, "Api", FakeApi)
    out = tmp_path / "report"
    assert compare_script.main(["--wandb", "e/p/g", "--out", str(out)]) == 0
    assert asked == {"path": "e/p", "filters": {"group": "g"}}
    rows = list(csv.DictReader((out / "compare.csv").open()))
    assert [r["run"] for r in rows] == ["api-gdn"]
    r = rows[0]
    assert (r["mixer"], float(r["val_loss"]), int(r["tokens"]), float(r["wall_s"])) == ("gdn", 1.9, 5120, 6.0)
    assert (int(r["params_total"]), int(r["params_active"])) == (9, 8) and r["source"].startswith("https://wandb.ai/")
    assert (r["group"], float(r["eval/val/bpb"]), float(r["eval/step_0000004/val/bpb"])) == ("g", 1.25, 1.5)
    assert "skipped api-running" in (out / "compare.md").read_text()
    with pytest.raises(SystemExit):
        compare_script.main(["--wandb", "just-a-project", "--out", str(out)])


def test_sweep_expands_lr_and_seed_axes():
    overrides = ["mixer=gdn,mamba2", "trainer.lr=1e-3,3e-3", "seed=0,1"]
    grid = sweep.expand_grid(overrides)
    assert len(grid) == 8 and grid[1] == ["mixer=gdn", "trainer.lr=1e-3", "seed=1"]
    assert sweep.job_name(grid[3], overrides) == "gdn-3e-3-1"
    cfg = compose(grid[3])
    assert (cfg.trainer.lr, cfg.seed) == (3e-3, 1)


def test_experiment_declares_its_lr_axis():
    """experiment=mqar sweeps trainer.lr unless it is given; mqar_quick and compare declare their own
    grids; an experiment without one adds no axis."""
    given = ["experiment=mqar", "mixer=gdn,mamba2"]
    assert sweep.with_config_axes(given) == given + ["trainer.lr=1e-3,3e-3,1e-2,3e-2"]
    assert sweep.with_config_axes(["experiment=mqar", "trainer.lr=1e-2"]) == ["experiment=mqar", "trainer.lr=1e-2"]
    assert sweep.with_config_axes(["experiment=mqar_quick"])[-1] == "trainer.lr=1e-3,3e-3,1e-2"
    assert sweep.with_config_axes(["experiment=compare"])[-1] == "trainer.lr=5e-3,1e-2,2e-2"
    assert sweep.with_config_axes(["experiment=quick"]) == ["experiment=quick"]


@pytest.mark.slow
def test_compare_best_over_lr_with_seeds(tmp_path):
    """--best-over trainer.lr: gdn is best at 3e-3 (MQAR accuracy, higher), softmax at 1e-3 (val loss,
    lower, no MQAR); the table gives the best lr's mean and min-max over the seeds and every lr's mean,
    one plot per architecture."""
    runs = tmp_path / "runs"
    acc = {1e-3: (0.2, 0.4), 3e-3: (0.9, 0.7), 1e-2: (0.1, 0.1)}  # gdn, per lr: seed 0, seed 1
    loss = {1e-3: (2.0, 2.2), 3e-3: (2.5, 2.5), 1e-2: (3.0, 3.2)}  # softmax
    gdn = tiny_config("experiment=mqar", "mixer=gdn", "trainer.seq_len=32", "data.vocab_size=64")
    softmax = tiny_config()

    def at(config, lr, seed):
        return {**config, "seed": seed, "trainer": {**config["trainer"], "lr": lr}}

    for lr in acc:
        for seed in (0, 1):
            mqar = [{**r, "val/mqar_acc": acc[lr][seed]} for r in train_rows([10, 10], [1.0, 0.5])]
            write_run(runs / f"gdn_{lr}_{seed}", at(gdn, lr, seed), mqar, params={"total": 1, "active": 1})
            write_run(runs / f"softmax_{lr}_{seed}", at(softmax, lr, seed), train_rows([10, 10], [3.0, loss[lr][seed]]),
                      params={"total": 1, "active": 1})
    # the same blocks with another option are another architecture, named by the option that differs
    other = {**softmax, "trainer": {**softmax["trainer"], "warmup_steps": 7}}
    for seed in (0, 1):
        write_run(runs / f"variant_{seed}", at(other, 1e-3, seed), train_rows([10, 20 + 20 * seed], [3.0, 2.4]),
                  params={"total": 1, "active": 1})
    out = tmp_path / "report"
    assert compare_script.main([str(runs), "--out", str(out), "--best-over", "trainer.lr"]) == 0
    md = (out / "compare.md").read_text()
    assert "| gdn-dense-d32 | mqar_acc | 0.003 | - | 0.8 | 0.7-0.9 | 2 | 0.001: 0.3, 0.003: 0.8, 0.01: 0.1 (0, 1) |" in md
    assert "| softmax-dense-d32 warmup_steps=7 | val_loss | 0.001 | single value | 2.4 | 2.4-2.4 | 2 | 0.001: 2.4 (0, 1) |" in md
    # and the other columns at the best lr, means over the seeds (tokens/s: 20 and 40 after the first log)
    assert "| softmax-dense-d32 warmup_steps=7 | 0.001 | 30 |" in md
    assert "| softmax-dense-d32 warmup_steps=10 | val_loss | 0.001 | low edge | 2.1 | 2-2.2 | 2 | 0.001: 2.1, 0.003: 2.5, 0.01: 3.1 (0, 1) |" in md
    assert md.count("| gdn_") + md.count("| softmax_") == 12  # every run stays in the full table
    for arch in ("gdn-dense-d32", "softmax-dense-d32_warmup_steps=10"):
        assert (out / "best_trainer_lr" / f"{arch}.png").stat().st_size > 1000
    # the two val-loss architectures on one axis; gdn alone has MQAR accuracy, so no all_mqar_acc.png
    assert (out / "best_trainer_lr" / "all_val_loss.png").stat().st_size > 1000
    assert not (out / "best_trainer_lr" / "all_mqar_acc.png").exists()
    assert (out / "mqar_state.png").exists()
    with pytest.raises(SystemExit, match="has no trainer.nope"):
        compare_script.main([str(runs), "--out", str(out), "--best-over", "trainer.nope"])


def test_sweep_takes_overrides_after_its_options(capsys):
    """`--launcher python --jobs 2 key=a,b`: overrides may follow the options (argparse's intermixed parse)."""
    assert sweep_script.main(["mixer=gdn", "--launcher", "python", "--jobs", "2", "seed=0,1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "sweep of 2 job(s)" in out and "seed=1" in out


@pytest.mark.slow
def test_compare_best_over_parametrization(tmp_path):
    """model.parametrization is an axis as trainer.lr is: a sweep expands it, and --best-over picks each
    architecture's best value (gdn: tied, by MQAR accuracy), the others staying in the table."""
    grid = sweep.expand_grid(["mixer=gdn", "model.parametrization=per_mixer,tied"])
    assert [compose(g).model.parametrization for g in grid] == ["per_mixer", "tied"]
    runs = tmp_path / "runs"
    gdn = tiny_config("experiment=mqar", "mixer=gdn", "trainer.seq_len=32", "data.vocab_size=64")
    acc = {"per_mixer": (0.5, 0.7), "tied": (0.9, 0.8)}
    for name, seeds in acc.items():
        for seed, a in enumerate(seeds):
            config = {**gdn, "seed": seed, "model": {**gdn["model"], "parametrization": name}}
            rows = [{**r, "val/mqar_acc": a} for r in train_rows([10, 10], [1.0, 0.5])]
            write_run(runs / f"gdn_{name}_{seed}", config, rows, params={"total": 1, "active": 1})
    out = tmp_path / "report"
    assert compare_script.main([str(runs), "--out", str(out), "--best-over", "model.parametrization"]) == 0
    md = (out / "compare.md").read_text()
    assert "| gdn-dense-d32 | mqar_acc | tied | - | 0.85 | 0.8-0.9 | 2 | per_mixer: 0.6, tied: 0.85 (0, 1) |" in md, md
    assert (out / "best_model_parametrization" / "gdn-dense-d32.png").stat().st_size > 1000


# ---- compare: grid edges, budgets, FLOPs, eval suites --------------------------------------------------
@pytest.fixture
def plotted(monkeypatch):
    """{PNG name: [(x data, y data) of each line of each axes]} of every figure saved (the files are still written);
    .styles: {PNG name: {legend label: (colour, line style)}}."""
    from matplotlib.figure import Figure

    class Plotted(dict):
        styles: dict = {}

    saved, savefig = Plotted(), Figure.savefig
    saved.styles = {}

    def record(fig, path, **kw):
        lines = [line for ax in fig.axes for line in ax.lines]
        saved[Path(path).name] = [(list(line.get_xdata()), list(line.get_ydata())) for line in lines]
        saved.styles[Path(path).name] = {line.get_label(): (line.get_color(), line.get_linestyle()) for line in lines
                                         if not line.get_label().startswith("_")}
        return savefig(fig, path, **kw)

    monkeypatch.setattr(Figure, "savefig", record)
    return saved


def at(config, lr, seed, **trainer):
    return {**config, "seed": seed, "trainer": {**config["trainer"], "lr": lr, **trainer}}


def test_grid_edge_values():
    assert best.grid_edge([5e-3, 1e-2, 2e-2], 2e-2) == ("high edge", [pytest.approx(4e-2)])
    assert best.grid_edge([5e-3, 1e-2, 2e-2], 5e-3) == ("low edge", [pytest.approx(2.5e-3)])
    assert best.grid_edge([5e-3, 1e-2, 2e-2], 1e-2) == (None, [])
    assert best.grid_edge([1e-3, 3e-3, 1e-2, 3e-2], 3e-2) == ("high edge", [pytest.approx(9e-2)])  # the ratio at that end
    assert best.grid_edge([3e-3], 3e-3) == ("single value", [1.5e-3, 6e-3])
    assert best.grid_edge([4, 8, 16], 16) == ("high edge", [32]) and best.grid_edge([0, 10, 20], 0) == ("low edge", [-10])
    assert best.grid_edge(["per_mixer", "tied"], "tied") == (None, [])
    assert best.grid_edge(["tied"], "tied") == ("single value", [])


@pytest.mark.slow
def test_compare_best_over_flags_the_grid_edge(tmp_path, capsys):
    """Grid 5e-3, 1e-2, 2e-2 over seeds 0 and 1: softmax is best at 2e-2 (high edge: extend to 4e-2, with the
    overrides of its own command line), gdn at 5e-3 (low edge: 2.5e-3, with the overrides that tell it from the
    others), mamba2 inside (not flagged), a warm-up variant at one lr (single value). Flags in compare.md (the edge
    column and a bold warning), on the console, in compare.csv and best_over.json."""
    runs = tmp_path / "runs"
    losses = {"softmax": {5e-3: 3.0, 1e-2: 2.8, 2e-2: 2.6}, "gdn": {5e-3: 2.5, 1e-2: 2.7, 2e-2: 2.9},
              "mamba2": {5e-3: 3.0, 1e-2: 2.0, 2e-2: 3.0}}
    for mixer, by_lr in losses.items():
        for lr, loss in by_lr.items():
            for seed in (0, 1):
                folder = runs / f"{mixer}_{lr}_{seed}"
                write_run(folder, at(tiny_config(f"mixer={mixer}"), lr, seed), train_rows([10, 10], [3.5, loss + seed / 10]),
                          params={"total": 1, "active": 1})
                if mixer == "softmax":  # Hydra's record of the job's command line
                    (folder / ".hydra").mkdir()
                    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(
                        ["mixer=softmax", f"trainer.lr={lr}", f"seed={seed}", f"run_dir={folder}", "++logger.group=g"]))
    for seed in (0, 1):
        write_run(runs / f"variant_{seed}", at(tiny_config(), 1e-2, seed, warmup_steps=7), train_rows([10, 10], [3.5, 2.4]),
                  params={"total": 1, "active": 1})
    out = tmp_path / "report"
    assert compare_script.main([str(runs), "--out", str(out), "--best-over", "trainer.lr"]) == 0
    md = (out / "compare.md").read_text()
    assert "| softmax-dense-d32 warmup_steps=10 | val_loss | 0.02 | high edge | 2.65 |" in md
    assert "| gdn-dense-d32 | val_loss | 0.005 | low edge | 2.55 |" in md
    assert "| mamba2-dense-d32 | val_loss | 0.01 | - | 2.05 |" in md
    assert "| softmax-dense-d32 warmup_steps=7 | val_loss | 0.01 | single value | 2.4 |" in md
    extend = {"softmax-dense-d32 warmup_steps=10": "python scripts/sweep.py mixer=softmax ++logger.group=g trainer.lr=0.04 seed=0,1",
              "gdn-dense-d32": "python scripts/sweep.py mixer=gdn trainer.warmup_steps=10 trainer.lr=0.0025 seed=0,1",
              "softmax-dense-d32 warmup_steps=7": "python scripts/sweep.py mixer=softmax trainer.warmup_steps=7 "
                                                  "trainer.lr=0.005,0.02 seed=0,1"}
    assert ("**Warning: softmax-dense-d32 warmup_steps=10: best trainer.lr 0.02 is at the high edge of the grid (0.005, 0.01, "
            f"0.02); extend it: {extend['softmax-dense-d32 warmup_steps=10']}**") in md
    console = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: ")]
    assert len(console) == 3 and all(any(line.endswith(f"extend it: {cmd}") for line in console) for cmd in extend.values())
    assert not any("mamba2" in line for line in console)
    rows = list(csv.DictReader((out / "compare.csv").open()))
    assert {(r["architecture"], r["edge"]) for r in rows} == {
        ("softmax-dense-d32 warmup_steps=10", "high edge"), ("gdn-dense-d32", "low edge"), ("mamba2-dense-d32", ""),
        ("softmax-dense-d32 warmup_steps=7", "single value")}
    report = {a["architecture"]: a for a in json.loads((out / "best_over.json").read_text())}
    assert report["softmax-dense-d32 warmup_steps=10"]["beyond"] == [pytest.approx(0.04)] and report["gdn-dense-d32"]["best"] == 5e-3
    assert report["mamba2-dense-d32"]["edge"] is None and report["mamba2-dense-d32"]["command"] is None
    assert {name: report[name]["command"] for name in extend} == extend
    assert sorted(report["softmax-dense-d32 warmup_steps=10"]["best_runs"]) == ["softmax_0.02_0", "softmax_0.02_1"]


@pytest.mark.slow
def test_compare_best_over_picks_on_the_seeds_every_value_ran(tmp_path):
    """The study's gdn at B2: seeds 0 and 1 at 1e-2 (seed 1 unlucky), seed 0 alone at 5e-3 and 2e-2. Over all
    seeds 5e-3 would win and be flagged at the low edge; on seed 0, the seed every lr ran, 1e-2 is best,
    inside the grid. The table still gives 1e-2's mean and min-max over both its seeds. Without a seed common
    to every lr, all seeds are compared."""
    runs = tmp_path / "runs"
    scores = {(5e-3, 0): 5.604, (1e-2, 0): 5.568, (1e-2, 1): 5.698, (2e-2, 0): 5.609,  # gdn
              (5e-3, 2): 3.0, (1e-2, 3): 2.0, (2e-2, 4): 2.5}  # mamba2: no seed at every lr
    for (lr, seed), loss in scores.items():
        mixer = "gdn" if seed < 2 else "mamba2"
        write_run(runs / f"{mixer}_{lr}_{seed}", at(tiny_config(f"mixer={mixer}"), lr, seed), train_rows([10, 10], [6.0, loss]),
                  params={"total": 1, "active": 1})
    out = tmp_path / "report"
    assert compare_script.main([str(runs), "--out", str(out), "--best-over", "trainer.lr"]) == 0
    md = (out / "compare.md").read_text()
    assert "| gdn-dense-d32 | val_loss | 0.01 | - | 5.633 | 5.568-5.698 | 2 | 0.005: 5.604, 0.01: 5.568, 0.02: 5.609 (0) |" in md, md
    assert "| mamba2-dense-d32 | val_loss | 0.01 | - | 2 | 2-2 | 1 | 0.005: 3, 0.01: 2, 0.02: 2.5 (all) |" in md, md
    report = {a["architecture"]: a for a in json.loads((out / "best_over.json").read_text())}
    assert (report["gdn-dense-d32"]["seeds_compared"], report["gdn-dense-d32"]["edge"]) == ([0], None)
    assert report["mamba2-dense-d32"]["seeds_compared"] == []


@pytest.mark.slow
def test_compare_best_over_tags_wandb_runs_on_the_edge(tmp_path, monkeypatch):
    """--wandb: the runs at a flagged architecture's best lr get the tag best-on-grid-edge (run.tags, run.update()),
    a stale tag on a run not at it is removed, and a run that refuses the change leaves a note, not an error."""
    import wandb

    class FakeRun:
        def __init__(self, name, lr, loss, tags=(), fail=False):
            self.name, self.state, self.url, self.group, self.summary = name, "finished", f"https://x/{name}", "g", {}
            self.config, self.tags, self.fail, self.updated = at(tiny_config(), lr, 0), list(tags), fail, 0
            self.history = [{"_step": 10, "_runtime": 1.0, "val/loss": loss, "tokens_seen": 100}]

        def scan_history(self):
            return iter(self.history)

        def update(self):
            if self.fail:
                raise RuntimeError("permission denied")
            self.updated += 1

    runs = [FakeRun("lr1", 1e-3, 3.0, tags=["best-on-grid-edge"]), FakeRun("lr2", 2e-3, 2.5, tags=["keep"]),
            FakeRun("lr4", 4e-3, 2.0)]
    monkeypatch.setattr(wandb, "Api", lambda: type("A", (), {"runs": lambda self, path, filters: runs})())
    assert compare_script.main(["--wandb", "e/p", "--out", str(tmp_path), "--best-over", "trainer.lr"]) == 0
    assert [(r.tags, r.updated) for r in runs] == [([], 1), (["keep"], 0), (["best-on-grid-edge"], 1)]
    runs[2].tags, runs[2].fail = [], True
    result = compare([], tmp_path, "e/p", "trainer.lr")
    assert "W&B tag best-on-grid-edge not added to lr4: permission denied" in result["notes"]


def test_budget_line():
    steps = tiny_config()
    flops = [at(tiny_config(), 1e-2, 0, flops_budget=1e9, max_steps=s) for s in (50, 70)]
    assert summary.budget_line(flops) == "equal FLOPs (trainer.flops_budget=1e+09)"
    assert summary.budget_line([at(steps, 1e-2, 0, tokens_budget=2e6)] * 2) == "equal tokens (trainer.tokens_budget=2e+06)"
    assert summary.budget_line([steps, at(steps, 3e-2, 1)]) == "equal steps (trainer.max_steps=120, tokens=30.7k)"  # 120 x 8 x 32
    assert summary.budget_line([*flops, steps]) == ("mixed budgets: trainer.flops_budget=1e+09 (2 runs); "
                                                   "trainer.max_steps=120, tokens=30.7k (1 run)")
    assert summary.budget_line([steps, at(steps, 1e-2, 0, batch_size=4)]).startswith("mixed budgets: ")


@pytest.mark.slow
def test_compare_flops_axis_and_budget_sections(tmp_path, plotted):
    """train_flops = final tokens x run_info's train_flops_per_token; val_bpb_flops.png plots val bpb against tokens
    seen x train_flops_per_token, val_bpb_time.png against time/elapsed. Under --best-over, runs at two FLOPs budgets
    are two architectures in two tables (max_steps, which a budget sets, does not split them), and in the figures one
    series: its end point at each budget (at that budget's best lr), the budgets' val curves drawn thin."""
    runs = tmp_path / "runs"
    for budget, per_token, better in ((1e9, 1000.0, 0.0), (2e9, 2000.0, 0.5)):
        for lr, steps in ((1e-2, 40), (2e-2, 40), (4e-2, 41)):
            rows = [{**r, "val/bpb": r["val/loss"] / 2}
                    for r in train_rows([10, 10], [3.0, 2.0 - better + 10 * abs(lr - 2e-2)])]
            folder = runs / f"{budget:g}_{lr}"
            write_run(folder, at(tiny_config(), lr, 0, flops_budget=budget, max_steps=steps), rows)
            (folder / "run_info.json").write_text(json.dumps({"params": {"total": 1, "active": 1},
                                                              "train_flops_per_token": per_token}))
    out = tmp_path / "report"
    compare([runs], out, best_over="trainer.lr")
    rows = list(csv.DictReader((out / "compare.csv").open()))
    assert {float(r["train_flops"]) for r in rows} == {20 * 256 * 1000.0, 20 * 256 * 2000.0}  # last log's tokens x per token
    assert {r["budget"] for r in rows} == {"trainer.flops_budget=1e+09", "trainer.flops_budget=2e+09"}
    # each budget's val curve at its best lr (2e-2), then the series through their ends (bpb 1.0 at 1e9, 0.75 at 2e9)
    assert plotted["val_bpb_flops.png"] == [([2.56e6, 5.12e6], [1.5, 1.0]), ([5.12e6, 10.24e6], [1.5, 0.75]),
                                            ([5.12e6, 10.24e6], [1.0, 0.75])]
    assert list(plotted.styles["val_bpb_flops.png"]) == ["softmax-dense-d32 (trainer.lr 0.02; 1 seed)"]
    assert plotted["val_bpb_time.png"][0][0] == [7.0, 14.0]
    # a row's own flops_seen (train.py logs it) where it has one; the zero-FLOPs log is off the log axis
    rows = [{"step": 0, "tokens_seen": 0, "flops_seen": 0, "val/loss": 4.0},
            {"step": 10, "tokens_seen": 5, "flops_seen": 7.0, "val/loss": 3.0}, {"step": 20, "tokens_seen": 10, "val/loss": 2.0}]
    assert summary.curve(Run("r", "r", {}, rows), {"train_flops_per_token": 100.0}, "flops", "val/loss") == [
        (7.0, 3.0), (1000.0, 2.0)]
    md = (out / "compare.md").read_text()
    assert "Budget: mixed budgets: trainer.flops_budget=1e+09 (3 runs); trainer.flops_budget=2e+09 (3 runs)." in md
    assert "## Best trainer.lr per architecture, equal FLOPs (trainer.flops_budget=1e+09)" in md
    assert "## Best trainer.lr per architecture, equal FLOPs (trainer.flops_budget=2e+09)" in md
    assert md.count("| 0.02 | - |") == 2  # each budget's lr grid is one architecture, best inside


@pytest.mark.slow
def test_every_figure_draws_an_architecture_in_its_colour(tmp_path, plotted):
    """Without --best-over, one series per architecture: two seeds at one budget are one point, their mean (the band
    spans them), two budgets two points of that series. One colour per mixer in every figure of the report; an
    architecture of the same mixer with another option gets its colour and its own line style."""
    runs = tmp_path / "runs"
    for mixer, seed, steps, loss in (("gdn", 0, 10, 3.0), ("gdn", 1, 10, 2.0), ("gdn", 0, 20, 1.5), ("softmax", 0, 10, 2.8)):
        write_run(runs / f"{mixer}_{steps}_{seed}", at(tiny_config(f"mixer={mixer}"), 1e-2, seed, max_steps=steps),
                  train_rows([10, 10], [4.0, loss]) if steps == 10 else train_rows([10] * 4, [4.0, 3.0, 2.0, loss]),
                  params={"total": 1, "active": 1})
    write_run(runs / "gdn_warm", at(tiny_config("mixer=gdn"), 1e-2, 0, max_steps=10, warmup_steps=7),
              train_rows([10, 10], [4.0, 2.6]), params={"total": 1, "active": 1})
    for name in ("gdn_10_0", "softmax_10_0", "gdn_warm"):
        (runs / name / "final" / "eval").mkdir()
        (runs / name / "final" / "eval" / "eval.json").write_text(json.dumps(eval_report()))
    compare([runs], tmp_path / "report")
    gdn, softmax, warm = ("gdn-dense-d32 warmup_steps=10 (1-2 seeds)", "softmax-dense-d32 (1 seed)",
                          "gdn-dense-d32 warmup_steps=7 (1 seed)")
    curves = plotted.styles["val_loss_tokens.png"]
    assert list(curves) == [gdn, warm, softmax]  # runs in folder order
    # the gdn series: its two seeds' mean at 10 steps, then its 20-step run's end
    assert ([10 * 2 * 256, 10 * 4 * 256], [2.5, 1.5]) in plotted["val_loss_tokens.png"]
    assert curves[gdn][0] == curves[warm][0] != curves[softmax][0] and curves[gdn][1] != curves[warm][1]
    for name, labels in (("length.png", ("gdn_10_0", "softmax_10_0")),
                         ("decode.png", ("gdn_10_0", "softmax_10_0")), ("recall_state.png", ("gdn_10_0", "softmax_10_0"))):
        colours = [plotted.styles[name][label][0] for label in labels]
        assert colours == [curves[gdn][0], curves[softmax][0]], name


def eval_report(seq_lens=(64, 128), bands=(2.0, 2.5), acc=((1.0, 0.5), (0.5, 0.0)), decode=(100.0, 50.0),
                choice=None, copy=(-0.5, -0.1)) -> dict:
    """A fake eval.py report with the length, recall and decode suites (training length 64); with `choice` (a row of
    forced-choice accuracy per context) the recall suite's graded scores too, else its report from before them."""
    graded = {} if choice is None else {"choice_acc": [list(c) for c in choice], "lift": [[2.0, 1.0], [1.0, 0.0]],
                                        "copy": list(copy), "candidates": 10}
    scores = {"recall/acc": sum(map(sum, acc)) / 4}
    if choice is not None:
        scores.update({"recall/choice_acc": sum(map(sum, choice)) / 4, "recall/lift": 1.0, "recall/copy": sum(copy) / 2})
    return {"scores": scores,
            "length": {"train_seq_len": 64, "seq_lens": list(seq_lens),
                       "per_position": {str(n): [3.0 - i / n for i in range(n)] for n in seq_lens},
                       "bands": dict(zip(("1x", "2x"), bands))},
            "recall": {"contexts": [128, 256], "depths": [0.0, 1.0], "acc": [list(a) for a in acc],
                       "answer_logprob": [[-1.0, -2.0]] * 2, **graded},
            "decode": {"contexts": [128, 256, 512], "rows": [
                {"context": 128, "prefill_tokens_per_sec": 1e4, "decode_tokens_per_sec": decode[0], "peak_mem_bytes": 1,
                 "cache_bytes": 1000, "cache_bytes_per_layer": 500},
                {"context": 256, "prefill_tokens_per_sec": 1e4, "decode_tokens_per_sec": decode[1], "peak_mem_bytes": 1,
                 "cache_bytes": 2000, "cache_bytes_per_layer": 1000},
                {"context": 512, "skipped": "out of memory"}]}}


@pytest.mark.slow
def test_compare_eval_suite_plots(tmp_path, plotted):
    """length.png, recall_state.png, recall_throughput.png, recall_graded.png and decode.png from fake eval.json (a run
    without the suites is left out), the band table and the graded recall table: per run, then per architecture at its
    best lr (mean over seeds)."""
    runs = tmp_path / "runs"
    reports = {"softmax_0": eval_report(),  # a recall report from before the graded scores
               "gdn_0": eval_report(bands=(2.2, 3.0), acc=((0.5, 0.5), (0.0, 0.0)), decode=(300.0, 280.0),
                                    choice=((1.0, 0.6), (0.2, 0.2))),
               "gdn_1": eval_report(bands=(2.4, 3.4), acc=((1.0, 1.0), (0.0, 0.0)), decode=(200.0, 180.0),
                                    choice=((0.6, 0.6), (0.4, 0.0)), copy=(-0.3, 0.1))}
    for name, config in (("softmax_0", tiny_config()), ("gdn_0", at(tiny_config("mixer=gdn"), 1e-2, 0)),
                         ("gdn_1", at(tiny_config("mixer=gdn"), 1e-2, 1)), ("plain", at(tiny_config("mixer=gdn"), 3e-2, 0))):
        write_run(runs / name, config, train_rows([10, 10], [3.0, 2.0 if name != "plain" else 2.5]),
                  params={"total": 1, "active": 1})
        if name in reports:
            (runs / name / "final" / "eval").mkdir()
            (runs / name / "final" / "eval" / "eval.json").write_text(json.dumps(reports[name]))
    out = tmp_path / "report"
    compare([runs], out)
    md = (out / "compare.md").read_text()
    assert "| softmax_0 | 2 | 2.5 |" in md and "| gdn_0 | 2.2 | 3 |" in md and "| gdn_1 | 2.4 | 3.4 |" in md
    assert "| plain |" not in md.split("## Loss by length")[1]
    for name in ("length.png", "recall_state.png", "recall_throughput.png", "recall_graded.png", "decode.png"):
        assert (out / name).stat().st_size > 1000, name
    curves = plotted["length.png"]
    from evaluation.per_position import log_binned
    from evaluation.suites.length import REPORT_BINS  # loss by position averaged in log-spaced bins

    assert len(curves) == 3 + 1 and curves[0] == log_binned([3.0 - i / 128 for i in range(128)], REPORT_BINS)  # + the line at T=64
    assert curves[0][0][0] == 1.0 and curves[0][1][0] == 3.0
    # recall at the largest context that every run's recall and decode suites have (256: 512 was skipped)
    # (runs in folder order: gdn_0, gdn_1, softmax_0)
    assert plotted["recall_state.png"] == [([2000], [0.0]), ([2000], [0.0]), ([2000], [0.25])]
    assert plotted["recall_throughput.png"] == [([280.0], [0.25]), ([180.0], [0.5]), ([50.0], [0.5])]
    assert plotted["decode.png"] == [([128, 256], [300.0, 280.0]), ([128, 256], [200.0, 180.0]), ([128, 256], [100.0, 50.0]),
                                     *[([128, 256], [1000, 2000])] * 3]
    # the graded recall of the runs that have it (softmax_0's report predates it), per context (mean over depths):
    # forced choice (gdn_0, gdn_1, the chance line), lift (gdn_0, gdn_1, 0), copy (gdn_0, gdn_1, 0)
    graded = [(x, pytest.approx(y)) for x, y in plotted["recall_graded.png"]]
    assert [y for _, y in graded] == [[0.8, 0.2], [0.6, 0.2], [0.1, 0.1], [1.5, 0.5], [1.5, 0.5], [0, 0],
                                      [-0.5, -0.1], [-0.3, 0.1], [0, 0]]
    assert graded[0][0] == graded[4][0] == graded[7][0] == [128, 256]
    graded = md.split("## Graded recall")[1]
    assert "| run | recall/acc | recall/choice_acc | recall/lift | recall/copy |" in graded
    assert "| gdn_0 | 0.25 | 0.5 | 1 | -0.3 |" in graded and "| softmax_0 | 0.5 | - | - | - |" in graded
    # gdn at its best lr (1e-2, the two seeds) averaged; softmax alone
    out = tmp_path / "best"
    compare([runs], out, best_over="trainer.lr")
    md = (out / "compare.md").read_text()
    assert "| gdn-dense-d32 | 2.3 | 3.2 |" in md and "| softmax-dense-d32 | 2 | 2.5 |" in md
    assert "| gdn-dense-d32 | 0.375 | 0.45 | 1 | -0.2 |" in md.split("## Graded recall")[1]
    assert plotted["recall_throughput.png"] == [([230.0], [0.375]), ([50.0], [0.5])]


def test_mqar_side_by_side_flags_the_lr_edge(tmp_path):
    """studies/mqar.py: ours best at the highest lr tried (5e-3, 1e-2: extend to 2e-2, ours only), the reference
    inside its lrs (not flagged); a mixer with one lr is flagged as a single value; the flags and the commands are in
    table.md."""
    from studies import mqar as side

    def runs(impl, mixer, accs):
        return [{"impl": impl, "mixer": mixer, "parametrization": "per_mixer" if impl == "ours" else "own", "d": 64,
                 "lr": lr, "seed": seed, "acc": acc, "curve": [[1, acc]]} for lr, by_seed in accs.items()
                for seed, acc in enumerate(by_seed)]

    rows = side.summarize(runs("ours", "gdn", {5e-3: (0.5, 0.6), 1e-2: (0.9, 0.8)})
                          + runs("qwen3_next_gdn", "qwen3_next_gdn", {1e-3: (0.1, 0.1), 3e-3: (0.7, 0.7), 1e-2: (0.2, 0.3)})
                          + runs("ours", "softmax", {1e-3: (0.4, 0.5)}))
    softmax, gdn = rows  # in MIXERS order
    assert (gdn["ours"]["edge"], gdn["ours"]["beyond"]) == ("high edge", [pytest.approx(2e-2)])
    assert gdn["ref"]["edge"] is None and softmax["ours"]["edge"] == "single value"
    side.write_table(rows, 500, tmp_path / "table.md", "python studies/mqar.py --seeds 0,1 --out r")
    table = (tmp_path / "table.md").read_text()
    assert ("| gdn | 64 | per_mixer | 0.850 (0.800-0.900) at 0.01 [high edge] | qwen3_next_gdn | "
            "0.700 (0.700-0.700) at 0.003 |") in table
    assert ("**Warning: gdn d 64, ours (per_mixer): best lr 0.01 is at the high edge of the grid (0.005, 0.01); extend it: "
            "python studies/mqar.py --seeds 0,1 --out r --mixers gdn --widths 64 --lrs 0.02 "
            "--parametrizations per_mixer --no-reference**") in table
    assert ("**Warning: softmax d 64, ours (per_mixer): best lr 0.001 is the only value swept (0.001); extend it: "
            "python studies/mqar.py --seeds 0,1 --out r --mixers softmax --widths 64 --softmax-lrs 0.0005,0.002 "
            "--parametrizations per_mixer --no-reference**") in table
    assert table.count("**Warning") == 2


def test_runs_of_different_sweeps_with_one_name_are_told_apart(tmp_path):
    """Two sweeps' job 0_0 are named <sweep folder>/0_0; a name used once stays as it is."""
    for folder in ("b2_softmax/0_0", "b2_gdn/0_0", "b2_gdn/1_1"):
        write_run(tmp_path / folder, tiny_config(), train_rows([100.0], [5.0]))
    runs, _ = discover([tmp_path])
    assert sorted(r.name for r in runs) == ["1_1", "b2_gdn/0_0", "b2_softmax/0_0"]


def test_an_mqar_run_is_a_recall_point():
    """An MQAR-trained run's recall block (accuracy over seq_len x num_kv_pairs, null where a cell cannot hold)
    gives the recall plots its accuracy at a seq_len: the mean over kv pairs."""
    from evaluation.suites.recall import recall_acc_at, recall_grid

    report = {"recall": {"mqar": {"seq_lens": [64, 128], "num_kv_pairs": [2, 8], "acc": [[1.0, 0.5], [0.5, None]]}}}
    assert recall_grid(report) == ([64, 128], [[1.0, 0.5], [0.5]])
    assert (recall_acc_at(report, 64), recall_acc_at(report, 128), recall_acc_at(report, 256)) == (
        0.75, 0.5, None)


@pytest.mark.slow
def test_compare_best_over_lr_of_state_accuracy(tmp_path, plotted):
    """experiment=state_tracking runs under --best-over trainer.lr: val/state_acc is the score (higher is better),
    its length bands are columns of compare.csv and of the at-best table (means over seeds), and
    state_acc_length.png draws each architecture at its best lr: the seeds' mean per band, and chance 1/2; a mixer's
    variants get their line styles in the order of their names (False solid), not in the order the runs are met."""
    runs = tmp_path / "runs"
    bands = {  # architecture -> lr -> each seed's accuracy in the bands 64, 128, 256, 512
        "false": {1e-3: ((0.7, 0.5, 0.5, 0.5), (0.9, 0.5, 0.5, 0.5)), 3e-3: ((0.6, 0.5, 0.5, 0.5), (0.6, 0.5, 0.5, 0.5))},
        "true": {1e-3: ((0.5,) * 4, (0.5,) * 4), 3e-3: ((1.0,) * 4, (1.0, 1.0, 0.75, 0.5))}}
    for neg, by_lr in bands.items():
        config = OmegaConf.to_container(compose(["experiment=state_tracking", "mixer=gdn",
                                                 f"mixer.options.allow_neg_eigval={neg}"]), resolve=True)
        for lr, seeds in by_lr.items():
            for seed, accs in enumerate(seeds):
                scores = {"val/state_acc": sum(accs) / 4, **{f"val/state_acc/{L}": a for L, a in zip((64, 128, 256, 512), accs)}}
                folder = runs / f"{neg == 'false':d}_gdn_{neg}_{lr}_{seed}"  # the True runs met first
                write_run(folder, at(config, lr, seed), [{**r, **scores} for r in train_rows([10, 10], [0.7, 0.1])])
                (folder / "run_info.json").write_text(json.dumps({  # as train.py writes it (the vocab is the data's)
                    "params": {"total": 1, "active": 1}, "train_flops_per_token": 1.0,
                    "data_info": {"task": "parity", "group_order": 2}}))
    out = tmp_path / "report"
    assert compare_script.main([str(runs), "--out", str(out), "--best-over", "trainer.lr"]) == 0
    md = (out / "compare.md").read_text()
    assert "| gdn-dense-d64 allow_neg_eigval=False | state_acc | 0.001 | low edge | 0.575 | 0.55-0.6 | 2 | 0.001: 0.575, 0.003: 0.525 (0, 1) |" in md, md
    neg = "gdn-dense-d64 allow_neg_eigval=True"
    assert f"| {neg} | state_acc | 0.003 | high edge | 0.9062 | 0.8125-1 | 2 | 0.001: 0.5, 0.003: 0.9062 (0, 1) |" in md
    header = next(line for line in md.splitlines() if line.startswith("| architecture | best trainer.lr | "))
    assert header.endswith("| state_acc/64 | state_acc/128 | state_acc/256 | state_acc/512 |")
    assert any(line.startswith("| gdn-dense-d64 allow_neg_eigval=False | 0.001 |") and line.endswith("| 0.8 | 0.5 | 0.5 | 0.5 |") for line in md.splitlines())
    assert any(line.startswith(f"| {neg} | 0.003 |") and line.endswith("| 1 | 1 | 0.875 | 0.75 |") for line in md.splitlines())
    row = next(r for r in csv.DictReader((out / "compare.csv").open()) if r["run"] == "0_gdn_true_0.003_1")
    assert (float(row["state_acc"]), float(row["state_acc/256"]), float(row["state_acc/512"])) == (0.8125, 0.75, 0.5)
    assert plotted["state_acc_length.png"][:2] == [([64, 128, 256, 512], [1.0, 1.0, 0.875, 0.75]),
                                                   ([64, 128, 256, 512], [0.8, 0.5, 0.5, 0.5])]
    styles = plotted.styles["state_acc_length.png"]
    assert list(styles) == [neg, "gdn-dense-d64 allow_neg_eigval=False", "chance 0.5"]
    assert (styles["gdn-dense-d64 allow_neg_eigval=False"][1], styles[neg][1]) == ("-", "--")
    assert plotted["state_acc_length.png"][2][1] == [0.5, 0.5]
    assert (out / "best_trainer_lr" / "all_state_acc.png").stat().st_size > 1000
