"""The documentation of a plugin's settings, read from its declarations: one `SettingDoc` per flag or option, and
option descriptions parsed from the options dataclass' HF-style `Args:` docstring."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["SettingDoc", "first_sentence", "parse_args_docstring", "refusal_note"]


@dataclass(frozen=True)
class SettingDoc:
    """One flag or option (`kind`) of a plugin as `trl-ext plugins` lists it: what it `accepts` (the parser's
    `expects`, or the field's type), its declared `default` and one line of `help`."""

    kind: str
    name: str
    accepts: str
    default: Any
    help: str

    def default_text(self) -> str:
        value = self.default
        if value is None or isinstance(value, bool):
            return {None: "None", True: "true", False: "false"}[value]
        return f'"{value}"' if isinstance(value, str) else str(value)


def first_sentence(text: str) -> str:
    text = " ".join(text.split())
    head, dot, _ = text.partition(". ")
    return head + "." if dot else text


def parse_args_docstring(doc: str) -> dict[str, str]:
    """`{name: description}` from an HF/Google-style `Args:` section."""
    out: dict[str, str] = {}
    lines = doc.expandtabs().splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return out
    indent = None
    current = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:
            break
        if depth == indent:
            match = re.match(r"\s*(\w+)\s*(\(.*\))?\s*:\s*(.*)", line)
            if not match:
                break
            current = match.group(1)
            out[current] = match.group(3).strip()
        elif current is not None:
            out[current] = (out[current] + " " + line.strip()).strip()
    return out


def refusal_note(expects: str, value: Any) -> str:
    """What to add to "must be <expects>, got <value>" when the value has a fraction where a whole number is
    expected (`256.5` for "a positive integer")."""
    try:
        number = float(value) if isinstance(value, str) else value
    except ValueError:
        return ""
    fractional = isinstance(number, float) and math.isfinite(number) and not number.is_integer()
    return " (not a whole number)" if fractional and "integer" in expects else ""
