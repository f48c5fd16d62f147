"""Every trainer, model, data, optimizer and eval option's valid values, checked once, before anything is
written: every bad value at once, one line each naming the key, the value and what is valid.

TRAIN_RULES / EVAL_RULES map a dotted key (list elements as key[]) to its Rule; every number or flag in a composed train.py / eval.py config must
have one (tests/test_validation.py enforces that, so a new option cannot go unchecked). Checks between
keys (heads that do not split a width, a batch that does not split into micro-batches) follow the
per-key ones. Block options (mixer.options.*, ffn.options.*) and eval suites' options (length.*, ...) are checked by their own
dataclasses (model/options.py)."""
import re
from dataclasses import dataclass

from omegaconf import OmegaConf

from data.state_tracking import TASKS as STATE_TRACKING_TASKS, eval_length
from model.config import PARAMETRIZATIONS, PER_MIXER
from training.budget import given_budget
from training.objectives import OBJECTIVES
from training.objectives.linearize import TRANSFER_TARGETS, parse_keep_softmax


@dataclass(frozen=True)
class Rule:
    kind: type                       # int, float, bool or str
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None
    choices: tuple | None = None
    nullable: bool = False

    def valid(self) -> str:
        if self.choices:
            text = "one of " + ", ".join(map(str, self.choices))
        else:
            text = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[self.kind]
            bounds = [f">= {self.at_least:g}" if self.at_least is not None else None,
                      f"> {self.above:g}" if self.above is not None else None,
                      f"<= {self.at_most:g}" if self.at_most is not None else None,
                      f"< {self.below:g}" if self.below is not None else None]
            text += " " + " and ".join(b for b in bounds if b) if any(bounds) else ""
        return text + (" or null" if self.nullable else "")

    def accepts(self, value) -> bool:
        if value is None:
            return self.nullable
        if self.choices:
            return value in self.choices
        if self.kind is bool:
            return isinstance(value, bool)
        numeric = (int, float) if self.kind is float else (self.kind,)
        if not isinstance(value, numeric) or isinstance(value, bool):
            return False
        return ((self.at_least is None or value >= self.at_least) and (self.above is None or value > self.above)
                and (self.at_most is None or value <= self.at_most) and (self.below is None or value < self.below))


def positive(nullable=False):
    return Rule(int, at_least=1, nullable=nullable)


def count(nullable=False):
    return Rule(int, at_least=0, nullable=nullable)


FLAG = Rule(bool)
FRACTION = Rule(float, above=0, below=1)  # strictly between 0 and 1

TRAIN_RULES = {
    "seed": count(),
    "objective": Rule(str, choices=tuple(OBJECTIVES.names())),
    "trainer.seq_len": Rule(int, at_least=2),  # position t predicts t + 1
    "trainer.batch_size": positive(),
    "trainer.grad_accum": positive(),
    "trainer.expert_parallel": positive(),
    "trainer.context_parallel": positive(),
    "trainer.max_steps": positive(nullable=True),  # null: set by a budget (training/budget.py)
    "trainer.flops_budget": Rule(float, above=0, nullable=True),
    "trainer.tokens_budget": Rule(float, above=0, nullable=True),
    "trainer.lr": Rule(float, at_least=0),  # 0: evaluate without training (studies/dsa.py's references)
    "trainer.min_lr_ratio": Rule(float, at_least=0, at_most=1),
    "trainer.warmup_steps": count(),
    "trainer.schedule": Rule(str, choices=("cosine", "wsd", "constant")),
    "trainer.wsd_decay_fraction": Rule(float, above=0, at_most=1),
    "trainer.grad_clip": Rule(float, above=0, nullable=True),
    "trainer.bf16": FLAG,
    "trainer.compile": FLAG,
    "trainer.log_every": positive(),
    "trainer.eval_every": positive(),
    "trainer.eval_batches": positive(nullable=True),
    "trainer.ckpt_every": positive(),
    "trainer.keep_checkpoints": count(),  # 0 keeps every checkpoint
    "trainer.sample_tokens": count(),
    "trainer.sample_temperature": Rule(float, at_least=0),
    "trainer.sample_top_p": Rule(float, above=0, at_most=1),
    "trainer.sample_repetition_penalty": Rule(float, above=0),
    "linearize.transfer_steps": count(),
    "linearize.transfer_loss": Rule(str, choices=("mse", "relative")),
    "linearize.transfer_target": Rule(str, choices=TRANSFER_TARGETS),
    "linearize.transfer_trains": Rule(str, choices=("new", "mixer")),
    "linearize.select_steps": count(),
    "linearize.distill_steps": count(),
    "linearize.temperature": Rule(float, above=0),
    "linearize.ce_weight": Rule(float, at_least=0),
    "model.hidden_size": positive(),
    "model.num_hidden_layers": positive(),
    "model.num_attention_heads": positive(),
    "model.num_key_value_heads": positive(nullable=True),
    "model.intermediate_size": positive(nullable=True),
    "model.max_position_embeddings": Rule(int, at_least=2),
    "model.parametrization": Rule(str, choices=(PER_MIXER, *PARAMETRIZATIONS)),
    "model.tie_word_embeddings": Rule(bool, nullable=True),  # null: the parametrization's
    "data.vocab_size": Rule(int, at_least=4),
    "data.val_fraction": FRACTION,
    "data.max_documents": positive(nullable=True),
    "data.max_tokens": positive(nullable=True),
    "data.document_mask": FLAG,
    "data.num_proc": positive(nullable=True),
    "data.bpe_train_bytes": positive(nullable=True),
    "data.cache_shared": FLAG,
    "data.streaming": FLAG,
    "data.power_a": Rule(float, above=0),
    "data.task": Rule(str, choices=STATE_TRACKING_TASKS),
    "data.modulus": Rule(int, at_least=2),
    "data.train_examples": positive(),
    "data.test_examples": positive(),
    "optimizer.weight_decay": Rule(float, at_least=0),
    "optimizer.momentum": Rule(float, at_least=0, below=1),
    "optimizer.nesterov": FLAG,
    "optimizer.ns_steps": positive(),
    "logger.mode": Rule(str, choices=("auto", "online", "offline", "disabled")),
    # elements of list options, [] standing for any index
    "optimizer.betas[]": Rule(float, at_least=0, below=1),
    **{f"data.{split}[].{field}": rule for split in ("train", "test")
       for field, rule in (("seq_len", Rule(int, at_least=2)), ("num_kv_pairs", positive()), ("num_examples", positive()))},
}

EVAL_RULES = {
    "seed": count(),
    "seq_len": Rule(int, at_least=2, nullable=True),
    "batch_size": positive(),
    "batches": count(nullable=True),  # 0: no perplexity
    "sample_tokens": count(),
    "num_samples": positive(),
    "sample_temperature": Rule(float, at_least=0),
    "sample_top_p": Rule(float, above=0, at_most=1),
    "sample_repetition_penalty": Rule(float, above=0),
    "limit": Rule(float, above=0, nullable=True),
    "num_fewshot": count(nullable=True),
    "lm_eval_batch_size": positive(),
    "wandb": FLAG,
    **{f"data.{k.removeprefix('data.')}": v for k, v in TRAIN_RULES.items() if k.startswith("data.")},
}


def leaves(config, prefix: str = "", lists: bool = True) -> dict:
    """{dotted key: value} of every scalar in a nested config; list elements are keyed <key>[<i>] (with
    lists=False a list is one value, as an override gives it: model.mixer=[gdn,softmax])."""
    if isinstance(config, dict):
        items = [(f"{prefix}.{k}" if prefix else str(k), v) for k, v in config.items()]
    elif isinstance(config, list) and lists:
        items = [(f"{prefix}[{i}]", v) for i, v in enumerate(config)]
    else:
        return {prefix: config}
    return {key: value for k, v in items for key, value in leaves(v, k, lists).items()}


def rule_for(key: str, rules: dict) -> Rule | None:
    return rules.get(re.sub(r"\[\d+\]", "[]", key))


def rule_problems(values: dict, rules: dict) -> dict[str, str]:
    """{key: its one-line problem} for every value its rule refuses."""
    return {key: f"{key}={value!r}; valid: {rule.valid()}" for key, value in values.items()
            if (rule := rule_for(key, rules)) is not None and not rule.accepts(value)}


def error_message(e: Exception) -> str:
    """What an entry point exits with: each line of e as `error: <line>` (a config's problems come all at once)."""
    return "\n".join(f"error: {line}" for line in str(e).splitlines())


def raise_problems(problems: list[str]) -> None:
    """Every problem at once: a ValueError of one line each (the entry points print each as `error: <line>`)."""
    if problems:
        raise ValueError("\n".join(problems))


def check_train_config(cfg) -> None:
    """The options of a composed train.py config, the blocks' options and the checks between keys that need no
    data or process count (training/run.py checks the batch against the processes, data/ the sequences): every
    problem at once, one line each."""
    raise_problems(train_config_problems(cfg))


def train_config_problems(cfg) -> list[str]:
    """check_train_config's problems. A check between keys runs only where the keys it reads passed their own."""
    values = leaves(OmegaConf.to_container(cfg, resolve=True))
    bad = rule_problems(values, TRAIN_RULES)
    problems = list(bad.values()) + block_problems(cfg)

    def fine(*keys: str) -> bool:  # no problem found in these keys yet
        return not any(key in bad for key in keys)

    def blame(*keys: str) -> None:  # a failed check between keys: the later checks that read them are skipped
        bad.update(dict.fromkeys(keys, ""))

    m, tc = cfg.model, cfg.trainer
    if fine("model.hidden_size", "model.num_attention_heads") and m.hidden_size % m.num_attention_heads:
        blame("model.hidden_size", "model.num_attention_heads")
        problems.append(f"model.hidden_size={m.hidden_size} does not split into model.num_attention_heads="
                        f"{m.num_attention_heads} heads; valid: a multiple of {m.num_attention_heads}")
    if (fine("model.num_key_value_heads", "model.num_attention_heads") and m.num_key_value_heads
            and m.num_attention_heads % m.num_key_value_heads):
        problems.append(f"model.num_key_value_heads={m.num_key_value_heads}; valid: a divisor of "
                        f"model.num_attention_heads={m.num_attention_heads}")
    if fine("trainer.batch_size", "trainer.grad_accum") and tc.batch_size % tc.grad_accum:
        problems.append(f"trainer.grad_accum={tc.grad_accum}; valid: a divisor of trainer.batch_size={tc.batch_size}")
    if fine("trainer.seq_len", "trainer.context_parallel") and tc.seq_len % tc.context_parallel:
        problems.append(f"trainer.seq_len={tc.seq_len} with trainer.context_parallel={tc.context_parallel}; valid: a "
                        f"multiple of {tc.context_parallel} (every rank holds an equal slice of each sequence)")
    if fine("trainer.seq_len", "model.max_position_embeddings"):
        if tc.seq_len > m.max_position_embeddings:
            problems.append(f"trainer.seq_len={tc.seq_len} exceeds model.max_position_embeddings="
                            f"{m.max_position_embeddings}")
        elif cfg.data.name == "state_tracking" and (longest := eval_length(tc.seq_len)) > m.max_position_embeddings:
            factor = longest // tc.seq_len
            problems.append(f"trainer.seq_len={tc.seq_len}; valid with data=state_tracking (tested at {factor} x "
                            f"trainer.seq_len = {longest} tokens): <= model.max_position_embeddings / {factor} = "
                            f"{m.max_position_embeddings // factor}")
    if fine("data.vocab_size") and cfg.data.get("tokenizer") == "bpe" and cfg.data.vocab_size < 257:
        problems.append(f"data.vocab_size={cfg.data.vocab_size}; valid: >= 257 with data.tokenizer=bpe "
                        f"(its 256 byte tokens and EOS)")
    budgets = fine("trainer.flops_budget", "trainer.tokens_budget", "trainer.max_steps")
    if budgets and tc.get("flops_budget") is not None and tc.get("tokens_budget") is not None:
        problems.append(f"trainer.flops_budget={tc.flops_budget:g} and trainer.tokens_budget={tc.tokens_budget:g}; "
                        f"valid: one of them")
    if budgets and tc.max_steps is None and given_budget(tc) is None:
        problems.append("trainer.max_steps=null; valid: a positive integer, or null with trainer.flops_budget or "
                        "trainer.tokens_budget (which set it)")
    lc = cfg.get("linearize")  # absent from the saved config of a run started before it existed
    stages = ("linearize.transfer_steps", "linearize.distill_steps")
    if tc.max_steps is not None and fine("trainer.max_steps", "trainer.warmup_steps", "trainer.wsd_decay_fraction",
                                         *(stages if lc is not None else ())):
        problems += steps_problems(cfg)  # with a budget, training/run.py checks these once it has set the steps
    if lc is not None and lc.get("keep_softmax") is not None and fine("model.num_hidden_layers"):
        kinds = OmegaConf.to_container(m, resolve=True).get("mixer") or cfg.mixer.name
        try:
            parse_keep_softmax(OmegaConf.to_container(lc, resolve=True)["keep_softmax"],
                               kinds if isinstance(kinds, list) else [kinds] * m.num_hidden_layers)
        except ValueError as e:
            problems.append(str(e))
    if lc is None or not fine(*stages):
        return problems
    if lc.transfer_steps + lc.distill_steps and not cfg.init_from:
        problems.append(f"linearize.transfer_steps={lc.transfer_steps}, linearize.distill_steps={lc.distill_steps} "
                        f"with init_from=null; valid: init_from=<the softmax teacher: run dir or HF dir>")
    if lc.transfer_steps + lc.distill_steps and cfg.objective != "linearize":
        problems.append(f"linearize.transfer_steps={lc.transfer_steps}, linearize.distill_steps={lc.distill_steps} "
                        f"with objective={cfg.objective}; valid: objective=linearize (experiment=linearize sets it)")
    return problems


def block_problems(cfg) -> list[str]:
    """The layers' block names (model.mixer / model.ffn: one, or one per layer) and the chosen blocks' options
    (mixer.options, ffn.options, each checked by the block's Options, model/options.py option_problems)."""
    from model.options import option_problems
    from model.registry import FFNS, MIXERS

    problems, m = [], cfg.model
    for group, registry in (("mixer", MIXERS), ("ffn", FFNS)):
        given = m.get(group)
        if OmegaConf.is_list(given) and len(given) != m.num_hidden_layers:
            problems.append(f"model.{group} lists {len(given)} layers; valid: one name per layer "
                            f"(model.num_hidden_layers={m.num_hidden_layers}), one name, or null")
        names = list(given) if OmegaConf.is_list(given) else [given or cfg[group].name]
        for name in dict.fromkeys(n for n in names if n not in registry.names()):
            problems.append(f"model.{group}: unknown {group} {name!r}; valid: {', '.join(registry.names())}")
        if cfg[group].name not in registry.names():
            continue
        options = getattr(registry.get(cfg[group].name), "Options", None)
        given_options = OmegaConf.to_container(cfg[group].options, resolve=True)
        if options is None and given_options:
            problems.append(f"{group}.options: {cfg[group].name} takes no options; given {sorted(given_options)}")
        elif options is not None:
            problems += [f"{group}.options: {line}" for line in option_problems(cfg[group].name, options, given_options)]
    return problems


def check_steps(cfg) -> None:
    """The checks that need trainer.max_steps: the warm-up and decay fit in it, so do linearize's stages."""
    raise_problems(steps_problems(cfg))


def steps_problems(cfg) -> list[str]:
    tc, lc = cfg.trainer, cfg.get("linearize")  # linearize is absent from the saved config of a run started before it
    problems = []
    decay = int(tc.max_steps * tc.wsd_decay_fraction)
    if tc.warmup_steps > tc.max_steps:
        problems.append(f"trainer.warmup_steps={tc.warmup_steps}; valid: <= trainer.max_steps={tc.max_steps}")
    elif tc.schedule == "wsd" and tc.warmup_steps + decay > tc.max_steps:
        problems.append(f"trainer.warmup_steps={tc.warmup_steps}; valid with schedule=wsd: <= trainer.max_steps - "
                        f"the {decay} decay steps (wsd_decay_fraction={tc.wsd_decay_fraction}) = {tc.max_steps - decay}")
    if lc is not None and lc.transfer_steps + lc.distill_steps > tc.max_steps:
        problems.append(f"linearize.transfer_steps={lc.transfer_steps} + linearize.distill_steps={lc.distill_steps}; "
                        f"valid: <= trainer.max_steps={tc.max_steps} (the stages are the run's first steps)")
    return problems


def check_eval_config(cfg) -> None:
    """eval.py's options (EVAL_RULES), the suites it names, and each suite's options node (its Options dataclass)."""
    from evaluation.suites import SUITES
    from model.options import option_problems

    values = OmegaConf.to_container(cfg, resolve=True)
    problems = list(rule_problems(leaves({k: v for k, v in values.items() if k not in SUITES.names()}),
                                  EVAL_RULES).values())
    problems += [f"suite={list(values['suite'])}: unknown suite {name!r}; valid: {', '.join(SUITES.names())}"
                 for name in values.get("suite") or [] if name not in SUITES.names()]
    for name in SUITES.names():
        problems += option_problems(f"{name} suite", SUITES.get(name).Options, values.get(name))
    raise_problems(problems)
