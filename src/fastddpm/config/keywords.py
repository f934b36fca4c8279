"""Config fields given as Python keywords (fastddpm.train(conditional=True, max_steps=1000)): each value must
already be of its field's type. coerce reads text for the command line and config files, where every value
arrives as text or YAML; from Python, text for a bool, a number or a list is a mistake it would hide
(conditional="no" is text that coerce reads as False, "1e-3" a learning rate), so it is refused by name."""

from __future__ import annotations

import os
import types
import typing
from typing import Any

from fastddpm.config.errors import ConfigError
from fastddpm.config.overrides import coerce, field_types, qualify
from fastddpm.config.schema import SECTIONS

# what each type takes from Python, as a message says it
_KINDS = {bool: "True or False", int: "a whole number (an int)", float: "a number", str: "a str"}


def check_keyword_types(keywords: dict[str, Any], where: str) -> None:
    """A ConfigError for the first keyword whose value is not of its field's type: text for a bool, a number or a
    list, a bool for a number. It names the keyword, the field, what the field takes and the value to pass.
    Keywords that name no field are left to resolve_config, which names the closest one."""
    for key, value in keywords.items():
        try:
            dotted = qualify(key, where)
        except ConfigError:
            continue
        section, name = dotted.split(".", 1)
        cls = SECTIONS.get(section)
        if cls is None or name not in cls.__dataclass_fields__:
            continue
        tp = field_types(cls)[name]
        choices = cls.__dataclass_fields__[name].metadata.get("choices") or ()
        if _takes(value, tp, choices):
            continue
        meant = ""
        if isinstance(value, str):  # the value the text spells, where it spells one
            try:
                meant = f": pass {key}={coerce(value, tp, dotted)!r}"
            except ConfigError:
                pass
        raise ConfigError(
            f"{where}: {key}={value!r} is {_a(type(value).__name__)}, and {dotted} takes {_kind(tp)}{meant} (a Python "
            f"keyword is taken as it is; text is read as a value only from the command line and config files)")


def _takes(value: Any, tp: Any, choices=()) -> bool:
    """Whether `value` is a Python value of type `tp`, one coerce keeps or converts without reading text."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if value is None:
            return len(options) < len(args)
        if isinstance(value, str) and str in options:  # `int | str` (batch_size "auto"): no number spelt as text
            numeric = [a for a in options if a in (int, float)]
            return not any(_parses(value, a) for a in numeric)
        return any(_takes(value, a, choices) for a in options)
    if origin is tuple:
        if isinstance(value, str):  # one name for a list of names; a comma list is text to split
            return args[:1] == (str,) and "," not in value
        return isinstance(value, (list, tuple)) and all(_takes(v, args[0]) for v in value)
    if tp is bool:
        return isinstance(value, bool)
    if tp in (int, float):  # any number coerce takes (a numpy scalar, a 0-d tensor; 2.5 steps it refuses itself)
        return not isinstance(value, (str, bool))
    if tp is str:  # a path as a pathlib.Path; True/False for a field of on/off choices (compile=False)
        on_off = isinstance(value, bool) and ("on" if value else "off") in choices
        return isinstance(value, (str, os.PathLike)) or on_off
    return True


def _a(noun: str) -> str:
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def _parses(text: str, tp: type) -> bool:
    try:
        coerce(text, tp, "")
    except ConfigError:
        return False
    return True


def _kind(tp: Any) -> str:
    """What a field of type `tp` takes, in words."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        words = [_kind(a) for a in args if a is not type(None)]
        return " or ".join(words + (["None"] if type(None) in args else []))
    if origin is tuple:
        element = {bool: "True/False values", int: "ints", float: "numbers", str: "strs"}.get(args[0], "values")
        return f"a list or tuple of {element}"
    return _KINDS.get(tp, getattr(tp, "__name__", str(tp)))

