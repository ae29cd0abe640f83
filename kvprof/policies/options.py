"""A policy's knobs: `Option` (default, choices, the values `--policy all` sweeps, where each choice comes from),
the parsers of option values, and a variant's label."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvprof.errors import KvprofError

ORIGINS = ("code", "paper text", "kvprof")  # where an option's choice comes from (`Option.origins`)


@dataclass(frozen=True)
class Option:
    """One knob of a policy: a command-line string that `parse` turns into the setting.

    default: the authors' public code's setting; choices: allowed values (None: any `parse` accepts); sweep: what
    `--policy all` replays (empty: the default); labelled: False for an option kept out of labels (a file path), one
    value per replay; origins: per choice one of `ORIGINS` ("code", "paper text" the code does not follow, "kvprof"),
    shown in `--help`."""

    default: str
    choices: tuple[str, ...] | None = None
    sweep: tuple[str, ...] = ()
    help: str = ""
    parse: Callable[[str], object] = str
    labelled: bool = True
    origins: dict[str, str] = field(default_factory=dict)

    def check(self, policy: str, key: str, value: str) -> object:
        """The parsed setting, or a `KvprofError` naming the policy, the option and the allowed values."""
        if self.choices is not None and value not in self.choices:
            raise KvprofError(
                f"policy {policy} option {key}={value!r} is not allowed; use one of {', '.join(self.choices)}."
            )
        try:
            return self.parse(value)
        except ValueError:
            meaning = f" ({key}: {self.help})" if self.help else ""
            raise KvprofError(f"policy {policy} option {key}={value!r} is not {self.kind}{meaning}.") from None

    @property
    def kind(self) -> str:
        """What a value must be: the parser's docstring, read at run time ("a number in [0, 1]"), else "a valid
        value"."""
        doc = "" if self.parse in (str, int, float) else (self.parse.__doc__ or "").strip()
        return doc[0].lower() + doc[1:].rstrip(".") if doc else "a valid value"

    def describe(self) -> str:
        """The option's values and meaning, for --help: its choices, or its kind and help."""
        if self.choices is not None:
            return "|".join(
                f"{choice} ({self.origins[choice]})" if choice in self.origins else choice for choice in self.choices
            )
        return f"{self.kind}: {self.help}" if self.parse is not str else self.help

    def label(self, key: str, value: str) -> str:
        """The value in a variant's label: a choice as is, else key=value; empty for an unswept option's default."""
        if not self.labelled or not self.sweep and value == self.default:
            return ""
        return value if self.choices is not None else f"{key}={value}"


def positive_int(value: str) -> int:
    """A whole number ≥ 1."""
    number = int(value)
    if number < 1:
        raise ValueError(value)
    return number


def layer_index(value: str) -> int:
    """A layer index ≥ 0."""
    index = int(value)
    if index < 0:
        raise ValueError(value)
    return index


def unit_interval(value: str) -> float:
    """A number in [0, 1]."""
    number = float(value)
    if not 0.0 <= number <= 1.0:
        raise ValueError(value)
    return number


def variant_label(name: str, options: dict[str, Option], values: dict[str, str]) -> str:
    """A variant's label: the policy name, then `-value` for each option that shows (`Option.label`)."""
    parts = [option.label(key, values.get(key, option.default)) for key, option in options.items()]
    return name + "".join(f"-{part}" for part in parts if part)
