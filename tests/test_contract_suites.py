"""The contract every registered eval suite passes, read from the registry (evaluation.suites.SUITES): a suite
added as its one file is checked here with no test file edited. Each runs through eval.py's own function
(evaluate_checkpoint, in this process) on the session's tiny trained checkpoint at its quick_options,
and must write its block of eval.json, finite scores named <suite>/..., and its plot; its options parse from
their defaults, and its quick_options are valid options."""
import dataclasses
import json
import math

import pytest

from evaluation.suites import SUITES
from model.options import parse_options

pytestmark = pytest.mark.usefixtures("one_thread")


def eval_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from evaluation.run import register_hydra
    from runs.config import CONFIG_DIR

    register_hydra()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("eval", overrides)


def hydra_value(v) -> str:
    return "[" + ",".join(map(str, v)) + "]" if isinstance(v, list) else str(v)


@pytest.mark.parametrize("name", SUITES.names())
def test_options_parse_and_quick_options_are_options(name):
    suite = SUITES.get(name)
    defaults = {f.name: getattr(suite.Options(), f.name) for f in dataclasses.fields(suite.Options)}
    assert parse_options(name, suite.Options, defaults) == suite.Options()
    assert suite.quick_options, f"{name}: no quick_options to test it with"
    parse_options(name, suite.Options, suite.quick_options)


@pytest.mark.slow
@pytest.mark.parametrize("name", SUITES.names())
def test_suite_runs_on_a_trained_checkpoint(name, tiny_run, data_cache, tmp_path):
    from eval import evaluate_checkpoint

    run, _ = tiny_run
    quick = [f"{name}.{k}={hydra_value(v)}" for k, v in SUITES.get(name).quick_options.items()]
    cfg = eval_config([f"checkpoint={run}", f"out_dir={tmp_path}", f"suite=[{name}]", *quick, "batches=0",
                       "sample_tokens=0", "wandb=false"])
    report = evaluate_checkpoint(cfg)
    assert json.loads((tmp_path / "eval.json").read_text()) == json.loads(json.dumps(report))
    assert isinstance(report[name], dict) and report[name]
    scores = {k: v for k, v in report["scores"].items() if k.startswith(f"{name}/")}
    assert scores and scores == report["scores"], report["scores"]  # batches=0, no samples: only the suite's
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in scores.values()), scores
    pngs = sorted(tmp_path.glob("*.png"))
    assert pngs and all(p.stat().st_size > 1000 for p in pngs), pngs
