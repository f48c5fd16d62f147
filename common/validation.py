"""The one checking mechanism for config values: a Rule says which values a key takes and, in one line, what
is valid. Each component declares the Rules of its own keys (a dict {dotted key: Rule}, list elements as
key[]) and its checks between keys; an entry point composes them and reports every problem at once, one line
each naming the key, the value and what is valid (Problems). Block and suite options (model/options.py) build
their Rules from their dataclass fields."""
import re
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    kind: type                       # int, float, bool, str or dict
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None
    choices: Collection | None = None  # a tuple, or a Registry: its names when checked
    nullable: bool = False

    def listed_choices(self) -> str:
        return ", ".join(map(str, self.choices))

    def valid(self) -> str:
        if self.choices:
            text = "one of " + self.listed_choices()
        else:
            text = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
                    dict: "a mapping"}[self.kind]
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
        if self.kind is bool:  # bool is an int to Python, not to a config; an int is a valid float
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


class Problems:
    """One config's problems in the order found: each value against its key's rule first, then the checks
    between keys, each run only where the keys it reads passed theirs (`fine`)."""

    def __init__(self, values: dict, rules: dict):
        self.bad = rule_problems(values, rules)
        self.lines = list(self.bad.values())

    def fine(self, *keys: str) -> bool:
        """No problem found in these keys yet."""
        return not any(key in self.bad for key in keys)

    def add(self, line: str, *blamed: str) -> None:
        """A failed check between keys; the later checks that read the `blamed` keys are skipped."""
        self.lines.append(line)
        self.bad.update(dict.fromkeys(blamed, ""))


def error_message(e: Exception) -> str:
    """What an entry point exits with: each line of e as `error: <line>` (a config's problems come all at once)."""
    return "\n".join(f"error: {line}" for line in str(e).splitlines())


def raise_problems(problems: list[str]) -> None:
    """Every problem at once: a ValueError of one line each (the entry points print each as `error: <line>`)."""
    if problems:
        raise ValueError("\n".join(problems))
