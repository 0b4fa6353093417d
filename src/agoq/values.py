"""Typed values from what people write: a TOML file's values and ``--section.key=value`` text,
each converted to its field's type, or refused in one line naming the field (standard library only:
reading a config or ``agoq plan``'s ``--model-field`` imports no torch)."""

from __future__ import annotations

import tomllib
import types
import typing
from typing import Any

from agoq.errors import ConfigError

# What a boolean may be written as, in any case (TOML's true and false, and the usual others).
BOOLEAN_SPELLINGS = ("true", "false", "yes", "no", "1", "0")


def coerce(value: Any, annotation: Any, where: str) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise ConfigError."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}={value!r} has the wrong type; expected {annotation}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if type(value) is int and value in (0, 1):  # "1" parses as the TOML integer 1
            return bool(value)
        if isinstance(value, str) and value.lower() in BOOLEAN_SPELLINGS:
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}={value!r} is not a boolean; use true or false (or yes/no, 1/0)")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{where}={value!r} is not an integer")
    if annotation is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}={value!r} is not a number") from None
    if annotation is str:
        return str(value)
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table of key = value pairs, got {value!r}")
        return dict(value)
    return value


def parse_value(text: Any, annotation: Any, where: str) -> Any:
    """A command-line value for a field typed ``annotation``, as ``--section.key=value`` takes it:
    TOML where it is one, else the text; ConfigError naming ``where`` when it does not fit."""
    return coerce(literal(text), annotation, where)


def is_text(annotation: Any) -> bool:
    """Whether a field holds a string (str, or str | None): its command-line value is taken as written."""
    if annotation is str:
        return True
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and str in typing.get_args(annotation)


def literal(text: Any) -> Any:
    """Parse a command-line value as TOML if it is one (numbers, booleans, tables), else keep the string."""
    if not isinstance(text, str):
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
