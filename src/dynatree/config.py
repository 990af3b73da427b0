"""Helpers shared by the per-method config dataclasses.

Every method has one dataclass; each field carries its help text, and the CLI adds one
option per field (`n_max` -> `--n-max`), so command line and config map 1:1.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import field
from typing import Callable

from .errors import DynaTreeError


@dataclasses.dataclass
class MethodConfig:
    """The base of every method's config dataclass: its fields are the method's options."""

    def validate(self) -> None:
        """Raise `DynaTreeError` naming the option when a value is out of range (defaults pass)."""

    def lossy(self) -> str | None:
        """Why sampled output with this config does not follow the target's distribution (WETAP's
        beam rule, MTAD's joint rule), or None: it does."""
        return None


def option(default, help: str):  # noqa: A002 - mirrors argparse's keyword
    """A config field with the help text the CLI shows for it."""
    return field(default=default, metadata={"help": help})


def argparse_help(text: str) -> str:
    """An option's help text as argparse takes it: argparse formats help with `%`, so a literal one
    ("98.9% of ...") is doubled."""
    return text.replace("%", "%%")


def field_type(f: dataclasses.Field) -> type:
    """The Python type of a config field (configs use `from __future__ import annotations`)."""
    return {"int": int, "float": float, "str": str, "bool": bool}[f.type if isinstance(f.type, str) else f.type.__name__]


def cli_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def renamed_options(message: str, names: set[str], name_of: Callable[[str], str]) -> tuple[str, list[str]]:
    """A method option's error, worded for the CLI (`--tau-h must be ...`), with the flags of the
    options `names` written `name_of(option)` instead (the Python API's keyword, the server's
    `dynatree.tau_h`); and the options it mentions, in order."""
    named: list[str] = []

    def renamed(match: re.Match) -> str:
        name = match.group(1).replace("-", "_")
        if name not in names:
            return match.group(0)
        named.append(name)
        return name_of(name)

    return re.sub(r"--([a-z0-9][a-z0-9-]*)", renamed, message), named


def require(condition: bool, message: str) -> None:
    if not condition:
        raise DynaTreeError(message)


def in_open_unit(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        require(0.0 < value < 1.0, f"{cli_flag(name)} must be in (0, 1), got {value}")


def in_unit(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        require(0.0 <= value < 1.0, f"{cli_flag(name)} must be in [0, 1), got {value}")


def positive(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        require(value >= 1, f"{cli_flag(name)} must be at least 1, got {value}")
