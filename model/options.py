"""Block options. A block with options declares them once, as a dataclass in its own file (the class
attribute `Options` of the block, fields built with `option`); `parse_options` builds it from a
config's dict and is the one place its values are checked. Hydra reads the same dataclasses
(training/config.py stores them as the schema of configs/mixer/*.yaml and configs/ffn/*.yaml
`options`), and LMConfig keeps them as plain dicts, as config.json stores them. A dict field holds the
options of a part the block picks by another option (the MoE's router_options, checked by the router's
own Options).

Checks that need the model's config (a head count dividing a width) stay in the block, with the
message `bad_option` writes."""
import dataclasses
import typing


def option(default, *, choices: tuple | None = None, at_least: float | None = None, above: float | None = None,
           at_most: float | None = None):
    """A dataclass field: its default and its valid values (one of `choices`, or a number >= at_least / > above /
    <= at_most); for a list option (annotated list[...]), of each element."""
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
                 if (line := _problem(block, f, annotations[f.name], given[f.name])) is not None]
    if parts and not problems and hasattr(options_class, "part_problems"):
        problems = options_class(**given).part_problems()
    return problems


def _problem(block: str, f: dataclasses.Field, annotation, value) -> str | None:
    if typing.get_origin(annotation) is list:  # list[int]: a list, each element checked as an option of that type
        if not isinstance(value, (list, tuple)) or not value:
            return str(bad_option(block, f.name, value, "a non-empty list"))
        return next((line for element in value
                     if (line := _problem(block, f, typing.get_args(annotation)[0], element)) is not None), None)
    allowed = typing.get_args(annotation) or (annotation,)  # int | None -> (int, NoneType)
    nullable = type(None) in allowed
    if value is None and nullable:
        return None
    kind = next(t for t in allowed if t is not type(None))
    choices, at_least, above, at_most = (f.metadata.get(k) for k in ("choices", "at_least", "above", "at_most"))
    if choices is not None:
        return None if value in choices else f"unknown {block} {f.name} {value!r}; valid: {', '.join(map(str, choices))}"
    # bool is an int to Python, not to a config; an int is a valid float
    ok = isinstance(value, bool) if kind is bool else (
        isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool))
    ok = ok and (at_least is None or value >= at_least) and (above is None or value > above) and (
        at_most is None or value <= at_most)
    if ok:
        return None
    bounds = [f"{sign} {bound}" for sign, bound in ((">=", at_least), (">", above), ("<=", at_most)) if bound is not None]
    valid = " ".join([{bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}[kind],
                      " and ".join(bounds)]).strip()
    return str(bad_option(block, f.name, value, valid + (" or null" if nullable else "")))
