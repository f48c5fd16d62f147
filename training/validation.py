"""train.py's config check: the trainer's own keys (trainer.*, seed, objective, logger.mode) and their checks
between keys, composed with every other component's, checked once, before anything is written: every bad
value at once, one line each naming the key, the value and what is valid (common/validation.py).

The components, in the order their checks between keys run: the model (model/config.py RULES, with its blocks'
names and options: model/options.py), the trainer (here), the data (data/options.py), the optimizer
(training/optim.py) and every registered objective (its `rules`: training/objectives/). Every number or flag in
a composed train.py config must have a rule (tests/test_validation.py enforces that, so a new option cannot go
unchecked)."""
from omegaconf import OmegaConf

from common.validation import FLAG, Problems, Rule, count, leaves, positive, raise_problems
from data import options as data_options
from model import config as model_config
from training import optim
from training.budget import given_budget, steps_problems
from training.objectives import OBJECTIVES

RULES = {
    "seed": count(),
    "objective": Rule(str, choices=OBJECTIVES),
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
    "logger.mode": Rule(str, choices=("auto", "online", "offline", "disabled")),
}
def objective_classes() -> list:
    """Every registered objective, read when a config is checked (one registered after this module is imported too)."""
    return [OBJECTIVES.get(name) for name in OBJECTIVES]


def train_rules() -> dict:
    """Every component's rules, composed: the model's, the trainer's, the data's, the optimizer's, each objective's."""
    return {**model_config.RULES, **RULES, **data_options.RULES, **optim.RULES,
            **{key: rule for objective in objective_classes() for key, rule in objective.rules.items()}}


def cross_checks(config: dict, problems: Problems) -> None:
    """The batch against its micro-batches, the sequence against the context-parallel ranks and the model's
    positions, the budget against trainer.max_steps, and the schedule within the steps."""
    tc, m = config["trainer"], config["model"]
    if problems.fine("trainer.batch_size", "trainer.grad_accum") and tc["batch_size"] % tc["grad_accum"]:
        problems.add(f"trainer.grad_accum={tc['grad_accum']}; valid: a divisor of trainer.batch_size={tc['batch_size']}")
    if problems.fine("trainer.seq_len", "trainer.context_parallel") and tc["seq_len"] % tc["context_parallel"]:
        problems.add(f"trainer.seq_len={tc['seq_len']} with trainer.context_parallel={tc['context_parallel']}; valid: "
                     f"a multiple of {tc['context_parallel']} (every rank holds an equal slice of each sequence)")
    if (problems.fine("trainer.seq_len", "model.max_position_embeddings")
            and tc["seq_len"] > m["max_position_embeddings"]):  # the later checks of the data's lengths skipped
        problems.add(f"trainer.seq_len={tc['seq_len']} exceeds model.max_position_embeddings="
                     f"{m['max_position_embeddings']}", "trainer.seq_len")
    budgets = problems.fine("trainer.flops_budget", "trainer.tokens_budget", "trainer.max_steps")
    if budgets and tc.get("flops_budget") is not None and tc.get("tokens_budget") is not None:
        problems.add(f"trainer.flops_budget={tc['flops_budget']:g} and trainer.tokens_budget={tc['tokens_budget']:g}; "
                     f"valid: one of them")
    if budgets and tc["max_steps"] is None and given_budget(tc) is None:
        problems.add("trainer.max_steps=null; valid: a positive integer, or null with trainer.flops_budget or "
                     "trainer.tokens_budget (which set it)")
    if tc["max_steps"] is not None and problems.fine("trainer.max_steps", "trainer.warmup_steps",
                                                     "trainer.wsd_decay_fraction"):
        problems.lines += steps_problems(config)  # with a budget, training/budget.py check_steps once it has set them


def check_train_config(cfg) -> None:
    """The options of a composed train.py config, the blocks' options and the checks between keys that need no
    data or process count (training/parallel.py micro_batch checks the batch against the processes, data/ the
    sequences): every problem at once, one line each."""
    raise_problems(train_config_problems(cfg))


def train_config_problems(cfg) -> list[str]:
    """check_train_config's problems: each value against train_rules(), then each component's checks between keys,
    each run only where the keys it reads passed their own."""
    config = OmegaConf.to_container(cfg, resolve=True)
    problems = Problems(leaves(config), train_rules())
    for component_checks in (model_config.cross_checks, cross_checks, data_options.cross_checks,
                             *(objective.cross_checks for objective in objective_classes())):
        component_checks(config, problems)
    return problems.lines
