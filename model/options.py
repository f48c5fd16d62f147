"""Block options. A block with options declares them once, as a dataclass in its own file (the class
attribute `Options` of the block, fields built with `option`); `parse_options` builds it from a
config's dict and is the one place its values are checked, each field against its Rule
(common/validation.py). Hydra reads the same dataclasses (runs/config.py stores them as the schema of
configs/mixer/*.yaml and configs/ffn/*.yaml `options`), and LMConfig keeps them as plain dicts, as config.json
stores them. A dict field holds the options of a part the block picks by another option (the MoE's
router_options, checked by the router's own Options). block_problems checks a train.py config's blocks: their
names and options.

Checks that need the model's config (a head count dividing a width) stay in the block, with the
message `bad_option` writes."""
import dataclasses
import typing
from collections.abc import Collection

from common.validation import Rule


def option(default, *, choices: Collection | None = None, at_least: float | None = None, above: float | None = None,
           at_most: float | None = None):
    """A dataclass field: its default and its valid values (one of `choices`, or a number >= at_least / > above /
    <= at_most), the Rule (common/validation.py) of its annotated type; for a list option (annotated list[...]),
    of each element."""
    metadata = {"choices": choices, "at_least": at_least, "above": above, "at_most": at_most}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def bad_option(block: str, name: str, value, valid: str) -> ValueError:
    return ValueError(f"{block} {name}={value!r}; valid: {valid}")


def parse_options(block: str, options_class, given: dict | None):
    """options_class(**given) after checking every given name and value; bad ones are a ValueError of one line
    each (option_problems)."""
    problems = option_problems(block, options_class, given, parts=False)
    if problems:
        raise ValueError("\n".join(problems))
    return options_class(**dict(given or {}))


def option_problems(block: str, options_class, given: dict | None, parts: bool = True) -> list[str]:
    """One line per problem of `given` as options_class: the unknown names (one line), each bad value; with parts,
    where there are none, also those of the parts the options pick (`part_problems()` of the built options: the
    MoE's router's)."""
    given = dict(given or {})
    fields = dataclasses.fields(options_class)
    unknown = sorted(set(given) - {f.name for f in fields})
    problems = [f"unknown {block} option(s) {unknown}; valid: {', '.join(f.name for f in fields)}"] if unknown else []
    annotations = typing.get_type_hints(options_class)
    problems += [line for f in fields if f.name in given
                 if (line := _field_problem(block, f, annotations[f.name], given[f.name])) is not None]
    if parts and not problems and hasattr(options_class, "part_problems"):
        problems = options_class(**given).part_problems()
    return problems


def _field_problem(block: str, f: dataclasses.Field, annotation, value) -> str | None:
    """The one line of a bad value of field f: checked by the Rule of its annotated type and `option` bounds."""
    if typing.get_origin(annotation) is list:  # list[int]: a list, each element checked as an option of that type
        if not isinstance(value, (list, tuple)) or not value:
            return str(bad_option(block, f.name, value, "a non-empty list"))
        return next((line for element in value
                     if (line := _field_problem(block, f, typing.get_args(annotation)[0], element)) is not None), None)
    allowed = typing.get_args(annotation) or (annotation,)  # int | None -> (int, NoneType)
    rule = Rule(next(t for t in allowed if t is not type(None)), nullable=type(None) in allowed, **f.metadata)
    if rule.accepts(value):
        return None
    if rule.choices is not None:
        return f"unknown {block} {f.name} {value!r}; valid: {rule.listed_choices()}"
    return str(bad_option(block, f.name, value, rule.valid()))


def block_problems(config: dict) -> list[str]:
    """The layers' block names in a train.py config (model.mixer / model.ffn: one, or one per layer) and the chosen
    blocks' options (mixer.options, ffn.options, each checked by the block's Options: option_problems)."""
    from model.registry import FFNS, MIXERS

    problems, m = [], config["model"]
    for group, registry in (("mixer", MIXERS), ("ffn", FFNS)):
        given, name = m.get(group), config[group]["name"]
        if isinstance(given, list) and len(given) != m["num_hidden_layers"]:
            problems.append(f"model.{group} lists {len(given)} layers; valid: one name per layer "
                            f"(model.num_hidden_layers={m['num_hidden_layers']}), one name, or null")
        names = list(given) if isinstance(given, list) else [given or name]
        for unknown in dict.fromkeys(n for n in names if n not in registry.names()):
            problems.append(f"model.{group}: unknown {group} {unknown!r}; valid: {', '.join(registry.names())}")
        if name not in registry.names():
            continue
        options, given_options = getattr(registry.get(name), "Options", None), config[group]["options"]
        if options is None and given_options:
            problems.append(f"{group}.options: {name} takes no options; given {sorted(given_options)}")
        elif options is not None:
            problems += [f"{group}.options: {line}" for line in option_problems(name, options, given_options)]
    return problems
