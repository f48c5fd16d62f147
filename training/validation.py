"""Every trainer, model, data, optimizer and eval option's valid values, checked once, before anything is
written: a bad value is one line naming the key, the value and what is valid.

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


def check_rules(values: dict, rules: dict) -> None:
    for key, value in values.items():
        if (rule := rule_for(key, rules)) is not None and not rule.accepts(value):
            raise ValueError(f"{key}={value!r}; valid: {rule.valid()}")


def check_train_config(cfg) -> None:
    """The options of a composed train.py config, then the checks between them that need no data or
    process count (training/run.py checks the batch against the processes, data/ the sequences)."""
    values = leaves(OmegaConf.to_container(cfg, resolve=True))
    check_rules(values, TRAIN_RULES)
    m, tc = cfg.model, cfg.trainer
    if m.hidden_size % m.num_attention_heads:
        raise ValueError(f"model.hidden_size={m.hidden_size} does not split into model.num_attention_heads="
                         f"{m.num_attention_heads} heads; valid: a multiple of {m.num_attention_heads}")
    if m.num_key_value_heads and m.num_attention_heads % m.num_key_value_heads:
        raise ValueError(f"model.num_key_value_heads={m.num_key_value_heads}; valid: a divisor of "
                         f"model.num_attention_heads={m.num_attention_heads}")
    if tc.batch_size % tc.grad_accum:
        raise ValueError(f"trainer.grad_accum={tc.grad_accum}; valid: a divisor of trainer.batch_size={tc.batch_size}")
    if tc.seq_len % tc.context_parallel:
        raise ValueError(f"trainer.seq_len={tc.seq_len} with trainer.context_parallel={tc.context_parallel}; valid: a "
                         f"multiple of {tc.context_parallel} (every rank holds an equal slice of each sequence)")
    if tc.seq_len > m.max_position_embeddings:
        raise ValueError(f"trainer.seq_len={tc.seq_len} exceeds model.max_position_embeddings={m.max_position_embeddings}")
    if cfg.data.name == "state_tracking" and (longest := eval_length(tc.seq_len)) > m.max_position_embeddings:
        factor = longest // tc.seq_len
        raise ValueError(f"trainer.seq_len={tc.seq_len}; valid with data=state_tracking (tested at {factor} x trainer.seq_len "
                         f"= {longest} tokens): <= model.max_position_embeddings / {factor} = {m.max_position_embeddings // factor}")
    if cfg.data.get("tokenizer") == "bpe" and cfg.data.vocab_size < 257:
        raise ValueError(f"data.vocab_size={cfg.data.vocab_size}; valid: >= 257 with data.tokenizer=bpe "
                         f"(its 256 byte tokens and EOS)")
    if tc.get("flops_budget") is not None and tc.get("tokens_budget") is not None:
        raise ValueError(f"trainer.flops_budget={tc.flops_budget:g} and trainer.tokens_budget={tc.tokens_budget:g}; "
                         f"valid: one of them")
    if tc.max_steps is None and given_budget(tc) is None:
        raise ValueError("trainer.max_steps=null; valid: a positive integer, or null with trainer.flops_budget or "
                         "trainer.tokens_budget (which set it)")
    if tc.max_steps is not None:  # with a budget, training/run.py checks these once it has set the steps
        check_steps(cfg)
    lc = cfg.get("linearize")  # absent from the saved config of a run started before it existed
    if lc is not None and lc.get("keep_softmax") is not None:
        kinds = OmegaConf.to_container(m, resolve=True).get("mixer") or cfg.mixer.name
        parse_keep_softmax(OmegaConf.to_container(lc, resolve=True)["keep_softmax"],
                           kinds if isinstance(kinds, list) else [kinds] * m.num_hidden_layers)
    if lc is not None and lc.transfer_steps + lc.distill_steps and not cfg.init_from:
        raise ValueError(f"linearize.transfer_steps={lc.transfer_steps}, linearize.distill_steps={lc.distill_steps} with "
                         f"init_from=null; valid: init_from=<the softmax teacher: run dir or HF dir>")
    if lc is not None and lc.transfer_steps + lc.distill_steps and cfg.objective != "linearize":
        raise ValueError(f"linearize.transfer_steps={lc.transfer_steps}, linearize.distill_steps={lc.distill_steps} with "
                         f"objective={cfg.objective}; valid: objective=linearize (experiment=linearize sets it)")
    for group in ("mixer", "ffn"):
        given = m.get(group)
        if OmegaConf.is_list(given) and len(given) != m.num_hidden_layers:
            raise ValueError(f"model.{group} lists {len(given)} layers; valid: one name per layer "
                             f"(model.num_hidden_layers={m.num_hidden_layers}), one name, or null")


def check_steps(cfg) -> None:
    """The checks that need trainer.max_steps: the warm-up and decay fit in it, so do linearize's stages."""
    tc, lc = cfg.trainer, cfg.get("linearize")  # linearize is absent from the saved config of a run started before it
    if tc.warmup_steps > tc.max_steps:
        raise ValueError(f"trainer.warmup_steps={tc.warmup_steps}; valid: <= trainer.max_steps={tc.max_steps}")
    decay = int(tc.max_steps * tc.wsd_decay_fraction)
    if tc.schedule == "wsd" and tc.warmup_steps + decay > tc.max_steps:
        raise ValueError(f"trainer.warmup_steps={tc.warmup_steps}; valid with schedule=wsd: <= trainer.max_steps - "
                         f"the {decay} decay steps (wsd_decay_fraction={tc.wsd_decay_fraction}) = {tc.max_steps - decay}")
    if lc is not None and lc.transfer_steps + lc.distill_steps > tc.max_steps:
        raise ValueError(f"linearize.transfer_steps={lc.transfer_steps} + linearize.distill_steps={lc.distill_steps}; "
                         f"valid: <= trainer.max_steps={tc.max_steps} (the stages are the run's first steps)")


def check_eval_config(cfg) -> None:
    """eval.py's options (EVAL_RULES), the suites it names, and each suite's options node (its Options dataclass)."""
    from evaluation.suites import SUITES
    from model.options import parse_options

    values = OmegaConf.to_container(cfg, resolve=True)
    check_rules(leaves({k: v for k, v in values.items() if k not in SUITES.names()}), EVAL_RULES)
    for name in values.get("suite") or []:
        if name not in SUITES.names():
            raise ValueError(f"suite={list(values['suite'])}: unknown suite {name!r}; valid: {', '.join(SUITES.names())}")
    for name in SUITES.names():
        parse_options(f"{name} suite", SUITES.get(name).Options, values.get(name))
