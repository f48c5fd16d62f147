"""Every bad trainer, model, data, optimizer and eval value is one line naming the key, the value and what
is valid, before anything is written (training/validation.py composes every component's rules, train_rules();
evaluation/validation.py eval.py's); a resumed run takes its saved config,
with only what may change on resume (training/config.py config_for_resume)."""
import copy
import functools
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from common.validation import leaves, rule_for
from conftest import ROOT
from evaluation.suites import SUITES
from evaluation.validation import EVAL_RULES, check_eval_config
from model.registry import MIXERS
from runs.config import compose, group_choices
from training.config import config_for_resume
from training.validation import check_train_config, train_config_problems, train_rules


@functools.cache
def composed_once(overrides: tuple):
    return compose(list(overrides))


def composed(*overrides):
    return copy.deepcopy(composed_once(overrides))


def every_train_config():
    """The composed train.py config of every data, optimizer and experiment choice (experiment=linearize
    with the init_from it needs)."""
    for data in group_choices("data"):
        for optimizer in group_choices("optimizer"):
            yield composed(f"data={data}", f"optimizer={optimizer}")
    for experiment in group_choices("experiment"):
        yield composed(f"experiment={experiment}", *(["init_from=teacher"] if experiment == "linearize" else []))


@pytest.mark.slow
def test_every_number_and_flag_has_a_rule():
    """A new option cannot go unchecked: every int, float or bool in any composed config (and in eval's)
    is covered by a rule of the composed set (block and suite options are their dataclasses' business)."""
    unchecked = set()
    for cfg in every_train_config():
        for key, value in leaves(OmegaConf.to_container(cfg, resolve=True)).items():
            if isinstance(value, (bool, int, float)) and not key.startswith(("mixer.", "ffn.")):
                if rule_for(key, train_rules()) is None:
                    unchecked.add(key)
    for key, value in leaves(OmegaConf.to_container(composed_eval(["checkpoint=x"]))).items():
        if isinstance(value, (bool, int, float)) and rule_for(key, EVAL_RULES) is None and key.split(".")[0] not in SUITES.names():
            unchecked.add(f"eval: {key}")
    assert not unchecked, sorted(unchecked)


def composed_eval(overrides: list[str]):
    """eval.py's config of these overrides, as Hydra composes it (each suite's node from its Options)."""
    from hydra import compose, initialize_config_dir

    from evaluation.run import register_hydra

    register_hydra()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("eval", overrides)


@pytest.mark.parametrize("override,message", [
    ("length.factors=[1,3]", "unknown length suite factors 3; valid: 1, 2, 4, 8, 16, 32"),
    ("recall.depths=[0.5,1.5]", "recall suite depths=1.5; valid: a number >= 0 and <= 1"),
    ("decode.tokens=0", "decode suite tokens=0; valid: an integer >= 1"),
])
def test_bad_suite_option_is_one_line(override, message):
    """A suite's options are checked by its Options dataclass, whether or not suite= names it."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_eval_config(composed_eval(["checkpoint=x", override]))


def test_a_misspelt_suite_option_is_refused_by_its_schema():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="length.factor"):
        composed_eval(["checkpoint=x", "length.factor=[1]"])


def bad_values(rule):
    """Values the rule must refuse: past each bound, the wrong type, null where not nullable."""
    if rule.choices:
        return ["nope"]
    if rule.kind is bool:
        return ["yes", 1]
    if rule.kind is str:
        return [3]
    out = ["abc"] if rule.kind is float else [1.5, "abc"]
    out += [rule.at_least - (1 if rule.kind is int else 0.5)] if rule.at_least is not None else []
    out += [rule.above] if rule.above is not None else []
    out += [rule.at_most + 0.5] if rule.at_most is not None else []
    out += [rule.below] if rule.below is not None else []
    return out + ([] if rule.nullable else [None])


def train_cases():
    for key, rule in train_rules().items():
        data = ("data=state_tracking" if key in ("data.task", "data.modulus", "data.train_examples", "data.test_examples") else
                "data=mqar" if key.startswith(("data.power_a", "data.train", "data.test")) else
                "data=hf" if key in ("data.max_tokens", "data.streaming", "data.bpe_train_bytes") else None)
        for value in bad_values(rule):
            yield pytest.param(key, value, data, id=f"{key}={value!r}")


@pytest.mark.parametrize("key,value,data", list(train_cases()))
def test_bad_train_value_is_one_line(key, value, data):
    cfg = composed(*([data] if data else []))
    target = key.replace("[]", "[0]")
    OmegaConf.update(cfg, target.replace("[0]", ".0") if "[0]" in target else target, value, force_add=True)
    with pytest.raises(ValueError) as e:
        check_train_config(cfg)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{target}={value!r}; valid: "), message


@pytest.mark.parametrize("key,value", [(k, v) for k, rule in EVAL_RULES.items() if not k.startswith("data.")
                                       for v in bad_values(rule)])
def test_bad_eval_value_is_one_line(key, value):
    cfg = OmegaConf.load(ROOT / "configs" / "eval.yaml")
    if key.endswith("[]"):  # a list option: the bad value as its first element
        key = key.removesuffix("[]")
        OmegaConf.update(cfg, key, [value])
        key += "[0]"
    else:
        OmegaConf.update(cfg, key, value)
    with pytest.raises(ValueError, match=f"^{key}={value!r}; valid: ".replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        check_eval_config(cfg)


@pytest.mark.parametrize("overrides,message", [
    (["model.hidden_size=100", "model.num_attention_heads=3"],
     "model.hidden_size=100 does not split into model.num_attention_heads=3 heads; valid: a multiple of 3"),
    (["model.num_attention_heads=4", "model.num_key_value_heads=3"],
     "model.num_key_value_heads=3; valid: a divisor of model.num_attention_heads=4"),
    (["trainer.batch_size=6", "trainer.grad_accum=4"], "trainer.grad_accum=4; valid: a divisor of trainer.batch_size=6"),
    (["trainer.seq_len=8192"], "trainer.seq_len=8192 exceeds model.max_position_embeddings=4096"),
    (["trainer.warmup_steps=500"], "trainer.warmup_steps=500; valid: <= trainer.max_steps=120"),
    (["trainer.schedule=wsd", "trainer.warmup_steps=110"], "trainer.warmup_steps=110; valid with schedule=wsd: <= "),
    (["data.vocab_size=200"], "data.vocab_size=200; valid: >= 257 with data.tokenizer=bpe"),
    (["model.mixer=[gdn,softmax]"], "model.mixer lists 2 layers; valid: one name per layer (model.num_hidden_layers=4)"),
    (["init_from=x", "objective=linearize", "linearize.transfer_steps=100", "linearize.distill_steps=30"],
     "linearize.transfer_steps=100 + linearize.distill_steps=30; valid: <= trainer.max_steps=120"),
    (["objective=linearize", "linearize.distill_steps=30"],
     "linearize.transfer_steps=0, linearize.distill_steps=30 with init_from=null; valid: init_from=<the softmax teacher"),
    (["mixer=derived_gdn", "linearize.keep_softmax=auto:5"], "linearize.keep_softmax=auto:5; valid: null, a list of "
     "layer indices in 0..3, or auto:<m> with 1 <= m <= 4 (the student's non-softmax layers)"),
    (["model.mixer=[derived_gdn,softmax,gdn,softmax]", "linearize.keep_softmax=auto:x"],
     "linearize.keep_softmax=auto:x; valid: null, a list of layer indices in 0..3, or auto:<m> with 1 <= m <= 2"),
    (["linearize.keep_softmax=[1,4]"], "linearize.keep_softmax=[1, 4]; valid: null, a list of layer indices in 0..3"),
    (["trainer.context_parallel=3"], "trainer.seq_len=256 with trainer.context_parallel=3; valid: a multiple of 3"),
])
def test_values_that_do_not_fit_each_other(overrides, message):
    with pytest.raises(ValueError) as e:
        check_train_config(composed(*overrides))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_every_shipped_config_passes():
    for cfg in every_train_config():
        check_train_config(cfg)
    check_eval_config(OmegaConf.load(ROOT / "configs" / "eval.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("overrides,line", [
    (["trainer.max_steps=0"], "error: trainer.max_steps=0; valid: an integer >= 1 or null"),
    (["data=local", "data.path=/nonexistent/x.txt"], "error: data.path '/nonexistent/x.txt' does not exist"),
    (["trainer.context_parallel=2"], "error: trainer.context_parallel=2; valid: a divisor of the process count (1)"),
    # several bad keys: every one named in the one launch, a line each (values, a block option, a check between keys)
    (["trainer.batch_size=0", "trainer.lr=-1", "model.num_attention_heads=3", "mixer=gdn", "mixer.options.conv_size=0",
      "model.mixer=[gdn,nope,gdn,gdn]"],
     "error: trainer.batch_size=0; valid: an integer >= 1\n"
     "error: trainer.lr=-1; valid: a number >= 0\n"
     f"error: model.mixer: unknown mixer 'nope'; valid: {', '.join(MIXERS.names())}\n"
     "error: mixer.options: gdn conv_size=0; valid: an integer >= 1\n"
     "error: model.hidden_size=256 does not split into model.num_attention_heads=3 heads; valid: a multiple of 3"),
])
def test_train_py_prints_each_problem_once_and_leaves_nothing(tmp_path, overrides, line):
    """Checked before anything is written, or failing while data is prepared: either way a line per problem, all
    in one launch, and no run dir (not even Hydra's .hydra/), here the default one (outputs/<date>/<time>_<name>
    under the working directory, as a first `python train.py` makes it: no run_dir given)."""
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip() == line, proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())


def test_a_sweep_and_eval_name_every_problem_at_once():
    """train.py -m's check of every job (training/jobs.py check_multirun) and eval.py's: every bad key of every
    job in one error, a line each."""
    from training.jobs import check_multirun

    with pytest.raises(ValueError) as e:
        check_multirun(["trainer.lr=-1,-2", "trainer.batch_size=0"])
    assert str(e.value).splitlines() == [
        "job 0 of 2 (trainer.lr=-1 trainer.batch_size=0): trainer.batch_size=0; valid: an integer >= 1",
        "job 0 of 2 (trainer.lr=-1 trainer.batch_size=0): trainer.lr=-1; valid: a number >= 0",
        "job 1 of 2 (trainer.lr=-2 trainer.batch_size=0): trainer.batch_size=0; valid: an integer >= 1",
        "job 1 of 2 (trainer.lr=-2 trainer.batch_size=0): trainer.lr=-2; valid: a number >= 0"]
    cfg = OmegaConf.load(ROOT / "configs" / "eval.yaml")
    cfg.batch_size, cfg.suite = 0, ["nope"]
    with pytest.raises(ValueError) as e:
        check_eval_config(cfg)
    assert [line.split(";")[0] for line in str(e.value).splitlines()] == ["batch_size=0", "suite=['nope']: unknown suite 'nope'"]


# ---- resume -------------------------------------------------------------------------------------
def saved_run(tmp_path):
    """A gdn + moe run's saved config.yaml, as train.py writes it."""
    cfg = composed("mixer=gdn", "ffn=moe", "trainer.max_steps=50", f"run_dir={tmp_path}")
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return OmegaConf.load(path), path


def resume_with(tmp_path, *overrides):
    saved, path = saved_run(tmp_path)
    given = [f"run_dir={tmp_path}", "resume=auto", *overrides]
    return config_for_resume(composed(*given), saved, given, path)


def test_resume_takes_the_saved_config(tmp_path):
    cfg = resume_with(tmp_path)
    assert (cfg.mixer.name, cfg.ffn.name, cfg.trainer.max_steps, cfg.trainer.lr) == ("gdn", "moe", 50, 0.005)
    assert cfg.resume == "auto" and cfg.name == "gdn-moe-tiny"


def test_resume_applies_what_may_change(tmp_path):
    cfg = resume_with(tmp_path, "trainer.max_steps=80", "trainer.eval_every=7", "logger=none", "trainer.sample_tokens=0")
    assert (cfg.trainer.max_steps, cfg.trainer.eval_every, cfg.logger.name, cfg.trainer.sample_tokens) == (80, 7, "none", 0)
    assert cfg.mixer.name == "gdn" and "project" not in cfg.logger  # logger=none replaced the logger group


def test_resume_takes_the_process_layout_default_a_run_predates(tmp_path):
    """A run saved before trainer.context_parallel existed resumes with its default, 1; on resume it may be given."""
    saved, path = saved_run(tmp_path)
    del saved.trainer["context_parallel"]
    given = [f"run_dir={tmp_path}", "resume=auto"]
    assert config_for_resume(composed(*given), saved, given, path).trainer.context_parallel == 1
    given.append("trainer.context_parallel=2")
    assert config_for_resume(composed(*given), saved, given, path).trainer.context_parallel == 2


@pytest.mark.parametrize("override,key", [
    ("mixer=softmax", "mixer.name"), ("ffn=dense", "ffn.name"), ("trainer.lr=0.5", "trainer.lr"),
    ("trainer.batch_size=16", "trainer.batch_size"), ("optimizer=adamw", "optimizer.name"), ("seed=3", "seed"),
    ("model.hidden_size=128", "model.hidden_size"), ("data.vocab_size=512", "data.vocab_size"),
    ("model.intermediate_size=256", "model.intermediate_size"), ("experiment=compare", "experiment_name"),
])
def test_resume_refuses_what_changes_the_run(tmp_path, override, key):
    with pytest.raises(ValueError) as e:
        resume_with(tmp_path, override)
    message = str(e.value)
    assert message.startswith(f"resume: {key} was ") and str(tmp_path / "config.yaml") in message and "\n" not in message


def test_a_misspelt_block_option_is_named_with_the_rest():
    """mixer.options / ffn.options are not in Hydra's struct mode: an option the block does not have reaches the
    validation and is named beside every other problem (a block without options takes none)."""
    problems = train_config_problems(composed("mixer=gdn", "mixer.options.nope=1", "trainer.lr=-1"))
    assert problems[:2] == ["trainer.lr=-1; valid: a number >= 0", "mixer.options: unknown gdn option(s) ['nope']; "
                            "valid: num_heads, head_dim, expand_v, conv_size, use_short_conv, chunk_size, allow_neg_eigval, conv_init, num_v_heads"]
    assert train_config_problems(composed("mixer.options.chunk_size=8")) == [
        "mixer.options: softmax takes no options; given ['chunk_size']"]
