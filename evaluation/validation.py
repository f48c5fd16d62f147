"""eval.py's config check: its own keys' rules, composed with the data's (data/options.py: data= may name the
data to score on), the suites it names, and each suite's options node (checked by its Options dataclass,
model/options.py): every problem at once, one line each (common/validation.py)."""
from omegaconf import OmegaConf

from common.validation import FLAG, Rule, count, leaves, positive, raise_problems, rule_problems
from data import options as data_options

RULES = {
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
}
EVAL_RULES = {**RULES, **data_options.RULES}


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
