"""Docs that cannot rot: every `python train.py ...`, `python eval.py ...`, `python scripts/...`, `python studies/...` and
`accelerate launch ...` command in README.md and docs/ is checked as it is written: Hydra commands
compose (every sweep value, the config checks included), script commands parse with the script's own
argument parser, and every repo file or config they name exists; so do the pages' relative links.
A placeholder in <angle brackets> stands for the user's own value."""
import argparse
import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)  # every block, whatever its language: a block's closing fence never opens one
SHELL = ("", "bash", "sh", "shell", "console")
EXTENDING = ROOT / "docs" / "extending.md"
INLINE = re.compile(r"`([^`\n]+)`")
STARTS = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:time\s+)?(python3?\s+(?:-m\s+(?:scripts|studies)\.\w+|eval\.py|train\.py"
                    r"|(?:scripts|studies)/\S+\.py)"
                    r"|accelerate\s+launch)\b")
REPO_PATH = re.compile(r"^(?:configs|scripts|studies|analysis|checks|docs|tests|model|data|training|common)/[\w./-]*[\w/]$|^[\w-]+\.(?:py|yaml|sh|txt)$")


def commands(page: Path) -> list[str]:
    """The commands a page shows: code-block lines (with `\\` continuations joined, comments dropped,
    `&&` chains split) and inline code spans that start like one. A synopsis (with "..."), a bare
    `accelerate launch` in prose and a chain after `git checkout <commit>` are not commands."""
    text = page.read_text()
    lines = []
    for language, block in FENCE.findall(text):
        if language in SHELL:
            lines += re.sub(r"\\\n\s*", " ", block).splitlines()
    lines += INLINE.findall(FENCE.sub("", text))
    found = []
    for line in lines:
        if line.strip().startswith("git checkout"):  # a command of another commit: that commit's files
            continue
        for part in line.split("&&"):
            part = re.sub(r"\s+#.*$", "", part.strip())
            if STARTS.match(part) and "..." not in part and part != "accelerate launch":
                found.append(part)
    return found


def example_names() -> set[str]:
    """What docs/extending.md has the reader write: the names its python blocks register."""
    blocks = [block for language, block in FENCE.findall(EXTENDING.read_text()) if language == "python"]
    return set(re.findall(r'\.register\("(\w+)"\)', "\n".join(blocks)))


def example_commands() -> list[str]:
    """docs/extending.md's commands that use a component the page has the reader write: they need its files, so
    test_the_new_mixer_and_objective_examples_train runs them with those files, in place of composing them."""
    names = example_names()
    return [c for c in commands(EXTENDING) if any(re.search(rf"(?<![\w-]){n}(?![\w-])", c) for n in names)]


def all_commands() -> list[tuple[str, str]]:
    examples = set(example_commands())
    return [(str(p.relative_to(ROOT)), c) for p in PAGES for c in commands(p) if not (p == EXTENDING and c in examples)]


def words(command: str) -> list[str]:
    """shlex words, placeholders <...> as X, leading VAR=value and `time` dropped."""
    out = shlex.split(re.sub(r"<[^<>]*>", "X", command))
    while out and (re.match(r"^[A-Z_]+=", out[0]) or out[0] == "time"):
        out.pop(0)
    return out


def check_paths(args: list[str]) -> None:
    for arg in args:
        for value in (arg, arg.partition("=")[2]):
            if "X" not in value and REPO_PATH.match(value) and not value.startswith("data/"):
                assert (ROOT / value).exists(), f"{value} does not exist"


@pytest.fixture(scope="module")
def hydra_configs():
    """Hydra's configs/ initialised once for the module (composing is then cheap)."""
    from hydra import initialize_config_dir

    from evaluation.run import register_hydra as register_eval
    from runs.config import register_hydra

    register_hydra()
    register_eval()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        yield


def check_train(args: list[str]) -> None:
    """train.py's overrides: the first and last job of the sweep they describe (with the experiment's
    own axes) compose and pass the config checks."""
    from hydra import compose
    from omegaconf import OmegaConf, open_dict

    from runs.config import check_group_overrides
    from runs.sweep import axis, expand_grid
    from training.validation import check_train_config

    multirun = bool({"-m", "--multirun"} & set(args))
    args = [a for a in args if a not in ("-m", "--multirun", "--cfg", "job", "X")]
    overrides = [a for a in args if not a.lstrip("+~").startswith(("hydra.", "hydra/"))]
    check_group_overrides(overrides)
    first = [axis(o)[0] for o in overrides]
    given = {o.partition("=")[0].lstrip("+~") for o in overrides}
    cfg = compose("train", first, return_hydra_config=True)
    axes = {k: v for k, v in (cfg.hydra.sweeper.params or {}).items() if k not in given}
    # the folder Hydra makes before train.py's main runs (a bad interpolation there is a Hydra traceback)
    assert OmegaConf.select(cfg, "hydra.sweep.dir" if multirun else "hydra.run.dir")
    with open_dict(cfg):
        del cfg["hydra"]
    check_train_config(cfg)
    last = expand_grid(overrides + [f"{k}={v}" for k, v in axes.items()])[-1]
    if last != first:
        check_train_config(compose("train", last))


def check_eval(args: list[str]) -> None:
    from hydra import compose

    from evaluation.validation import check_eval_config

    check_eval_config(compose("eval", args))


class Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


def check_script(module_name: str, args: list[str], monkeypatch) -> argparse.Namespace:
    """The script's own argument parser on these arguments (main() stops right after parsing)."""
    def parse_and_stop(self, argv=None, namespace=None):
        raise Parsed(original(self, argv, namespace))

    def parse_intermixed_and_stop(self, argv=None, namespace=None):
        raise Parsed(original_intermixed(self, argv, namespace))

    original = argparse.ArgumentParser.parse_args
    original_intermixed = argparse.ArgumentParser.parse_intermixed_args
    module = importlib.import_module(module_name)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_intermixed_args", parse_intermixed_and_stop)
    monkeypatch.setattr(sys, "argv", [module_name, *args])
    try:
        module.main()
    except Parsed as p:
        return p.namespace
    except SystemExit as e:
        if e.code == 0:  # --help
            return argparse.Namespace()
        raise AssertionError(f"{module_name} {' '.join(args)}: the parser refused it (exit {e.code})") from None
    raise AssertionError(f"{module_name} did not parse its arguments")


def check(command: str, monkeypatch) -> None:
    w = words(command)
    if w[0] == "accelerate":  # accelerate launch [--config_file F ...] train.py ...
        check_paths(w[2:])
        w = ["python", *w[w.index(next(a for a in w if a.endswith("train.py"))):]]
    script = w[2].replace(".", "/") + ".py" if w[1] == "-m" else w[1]
    args = w[3:] if w[1] == "-m" else w[2:]
    if "X" in script:  # python scripts/<name>.py: any script
        return
    assert (ROOT / script).exists(), f"{script} does not exist"
    check_paths(args)
    if script.endswith("train.py"):
        check_train(args)
    elif script == "eval.py":
        check_eval(args)
    else:
        parsed = check_script(script.removesuffix(".py").replace("/", "."), args, monkeypatch)
        if script == "scripts/sweep.py" and "overrides" in parsed:
            check_train(parsed.overrides)
        if script == "scripts/bench.py" and "suites" in parsed:
            from scripts.bench import SUITES
            assert set(parsed.suites) - {"X"} <= set(SUITES), parsed.suites


def test_the_docs_show_commands():
    found = all_commands()
    pages = {page for page, _ in found}
    assert "README.md" in pages and len(found) > 20, found
    assert any(c.startswith("accelerate launch") for _, c in found)


@pytest.mark.parametrize("page,command", all_commands(), ids=lambda x: x[:80] if isinstance(x, str) else x)
def test_every_documented_command_composes(page, command, monkeypatch, hydra_configs):
    check(command, monkeypatch)


@pytest.mark.parametrize("bad,why", [
    ("python train.py mixer=nope", "unknown mixer 'nope'"),
    ("python train.py trainer.max_steps=0", "trainer.max_steps=0; valid"),
    ("python train.py trainer.stepz=3", "Could not override 'trainer.stepz'"),
    ("python train.py -m experiment=mqar mixer=gdn,nope", "unknown mixer 'nope'"),
    ("python scripts/compare.py runs/ --best-overr trainer.lr", "the parser refused it"),
    ("python scripts/sweep.py mixer=gdn trainer.max_steps=0 --dry-run", "trainer.max_steps=0; valid"),
    ("python eval.py checkpoint=x batch_size=0", "batch_size=0; valid"),
    ("python scripts/bench.py nosuchsuite", "nosuchsuite"),
    ("accelerate launch --config_file configs/accelerate/nope.yaml train.py", "configs/accelerate/nope.yaml does not exist"),
    ("python scripts/nope.py", "scripts/nope.py does not exist"),
    ("python studies/mqar.py --mixers", "the parser refused it"),
])
def test_the_check_catches_a_broken_command(bad, why, monkeypatch, hydra_configs):
    with pytest.raises(BaseException) as e:
        check(bad, monkeypatch)
    assert why in str(e.value)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if not re.match(r"^[a-z]+://", target):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def doc_block(page: Path, language: str, first_line: str) -> str:
    """The ```<language> block of page whose first line is first_line, as written."""
    blocks = [b for b in re.findall(rf"```{language}\n(.*?)```", page.read_text(), re.S) if b.startswith(first_line + "\n")]
    assert len(blocks) == 1, f"{page.name}: {len(blocks)} {language} blocks start with {first_line!r}"
    return blocks[0]


# In a fresh process: exec the example files (a mixer's @MIXERS.register runs before train.py's register_hydra() stores
# its Options as mixer_options/<name>), then
# train.py's main on each run's overrides, one after another, then eval.py's on each evaluation's (imported, their
# configs/ given as an absolute --config-path: Hydra would look for a module)
TRAIN_WITH_FILES = """
import json, sys, types
from pathlib import Path

root, files, runs, evals = sys.argv[1:]
sys.path.insert(0, root)
for file in json.loads(files):
    module = types.ModuleType(f"extending_{Path(file).stem}")  # not the stdlib's name (copy.py)
    sys.modules[module.__name__] = module
    exec(compile(Path(file).read_text(), file, "exec"), module.__dict__)

import train
from accelerate.state import AcceleratorState

for overrides in json.loads(runs):
    sys.argv = ["train.py", f"--config-path={root}/configs", *overrides]
    train.main()
    AcceleratorState._reset_state(reset_partial_state=True)

import eval as eval_entry
from evaluation.suites import SUITES

for overrides in json.loads(evals):  # each suite at its quick_options, after the command's own
    suites = next((o.partition("=")[2].strip("[]").split(",") for o in overrides if o.startswith("suite=")), [])
    quick = [f"{s}.{k}={v if isinstance(v, str) else json.dumps(v)}" for s in suites for k, v in SUITES.get(s).quick_options.items()]
    sys.argv = ["eval.py", f"--config-path={root}/configs", *overrides, *quick]
    eval_entry.main()
    checkpoint = next(o.partition("=")[2] for o in overrides if o.startswith("checkpoint="))
    print("eval scores:", json.dumps(sorted(json.loads(next(Path(checkpoint).rglob("eval.json")).read_text())["scores"])))
"""


@pytest.mark.slow
def test_the_new_mixer_and_objective_examples_train(tmp_path, data_cache):
    """docs/extending.md's examples, their files as written (in tmp_path, configs/ on Hydra's search path): the shift
    mixer trains 2 steps under experiment=mqar and experiment=state_tracking (each sets model.parametrization=per_mixer,
    which gives shift, declaring none, llama's untied output layer); the label-smoothing objective trains 2 steps
    beside, with a loss above the plain cross-entropy it logs; and every command of the page that uses an example
    (example_commands: the shift mixer's and the tempered router's train.py runs, the eval.py runs of the copy suite
    and of the suites on the shift run) runs as written, at 2 steps of a tiny model and each suite's quick options."""
    import json
    import subprocess

    (tmp_path / "examples").mkdir()  # not the working directory, which is on sys.path ahead of the stdlib
    files = {name: tmp_path / "examples" / f"{name}.py" for name in ("shift", "smoothed", "tempered", "copy")}
    files["shift"].write_text(doc_block(EXTENDING, "python", "# model/mixers/shift.py"))
    files["smoothed"].write_text(doc_block(EXTENDING, "python", "# training/objectives/smoothed.py"))
    files["tempered"].write_text(doc_block(EXTENDING, "python", "# model/ffn/routers/tempered.py"))
    files["copy"].write_text(doc_block(EXTENDING, "python", "# evaluation/suites/copy.py"))
    assert set(files) == example_names()
    (tmp_path / "configs" / "mixer").mkdir(parents=True)
    (tmp_path / "configs" / "mixer" / "shift.yaml").write_text(doc_block(EXTENDING, "yaml", "# configs/mixer/shift.yaml"))
    tiny = ["model.hidden_size=32", "trainer.seq_len=16", "trainer.batch_size=8", "trainer.max_steps=2",
            "trainer.warmup_steps=1", "trainer.eval_every=2", "trainer.log_every=1", f"hydra.searchpath=[file://{tmp_path / 'configs'}]"]
    mqar = ["mixer=shift", "experiment=mqar", "data.train=[{seq_len:16,num_kv_pairs:2,num_examples:64}]",
            "data.test=[{seq_len:16,num_kv_pairs:2,num_examples:8}]"]
    runs = {"mqar": mqar, "state_tracking": ["mixer=shift", "experiment=state_tracking", "data.task=s3",
                                             "data.train_examples=64", "data.test_examples=4"],
            "smoothed": [*mqar, "objective=smoothed"]}
    evals = []
    for command in example_commands():  # outputs/<name> in the page: tmp_path/<name>; outputs/<run>: the shift run
        args = [a.replace("outputs/X", "outputs/shift").replace("outputs/", f"{tmp_path}/") for a in words(command)[2:]]
        if words(command)[1] == "train.py":
            given = next((a.partition("=")[2] for a in args if a.startswith("run_dir=")), None)
            runs[Path(given).name if given else f"page_{len(runs)}"] = [a for a in args if not a.startswith("run_dir=")]
        else:
            evals.append([*args, f"hydra.searchpath=[file://{tmp_path / 'configs'}]"])
    assert "shift" in runs and len(runs) == 5 and len(evals) == 2, (runs, evals)
    proc = subprocess.run([sys.executable, "-c", TRAIN_WITH_FILES, str(ROOT), json.dumps([str(f) for f in files.values()]),
                           json.dumps([[*overrides, *tiny, f"run_dir={tmp_path / name}"] for name, overrides in runs.items()]),
                           json.dumps(evals)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name, metric in (("mqar", "val/mqar_acc"), ("state_tracking", "val/state_acc"), ("smoothed", "val/mqar_acc")):
        info = json.loads((tmp_path / name / "run_info.json").read_text())
        assert info["layer_mixers"] == ["shift", "shift"], info
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if metric in r] == [2], rows
        assert json.loads((tmp_path / name / "final" / "config.json").read_text())["tie_word_embeddings"] is False
    assert "objective smoothed: cross-entropy with label smoothing 0.1 for 2 steps" in proc.stdout + proc.stderr
    assert "objective: smoothed" in (tmp_path / "smoothed" / "config.yaml").read_text()
    router_run = next(tmp_path / name for name in runs if name.startswith("page_"))
    assert '"router": "tempered"' in (router_run / "final" / "config.json").read_text()
    scored = [{k.split("/")[0] for k in json.loads(line.removeprefix("eval scores: "))}
              for line in proc.stdout.splitlines() if line.startswith("eval scores: ")]
    assert len(scored) == 2 and {"length", "recall", "decode"} <= scored[0] and "copy" in scored[1], scored
